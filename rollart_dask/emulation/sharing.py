"""What the policy simulator (simulate.py) shares among trajectories: an engine pool's instances, shared among the
turns generating on it (processor sharing: each turn at most as fast as it would run alone), and the turn barrier
of batch-level rollout. They call back into the simulation (``sim.now``, ``sim.at``, ``sim.resume``)."""

from __future__ import annotations


class SharedPool:
    """An engine pool's instances shared among the turns generating on it (processor sharing)."""

    def __init__(self, sim: "object", instances: int, keep_partial: bool = False):
        self.sim, self.cap = sim, float(instances)
        self.keep_partial = keep_partial  # rollout.partial=continue: a turn Suspend interrupts keeps the work it has done
        self.jobs: dict[str, list] = {}  # trajectory → [work left, top rate, full work]
        self.rates: dict[str, float] = {}
        self.at = 0.0
        self.token = 0
        self.paused = False

    def add(self, tid: str, work: float, latency: float) -> None:
        self._advance()
        self.jobs[tid] = [work, work / latency if latency > 0 else float("inf"), work]
        self._reschedule()

    def remove(self, tid: str) -> None:
        if tid in self.jobs:
            self._advance()
            del self.jobs[tid]
            self._reschedule()

    def pause(self) -> None:
        """Suspend: every turn in flight is aborted; at Resume it starts again from nothing (restart) or goes on from
        where it was (continue; the re-prefill of its prefix is not modelled)."""
        self._advance()
        self.paused = True
        for job in self.jobs.values():
            if not self.keep_partial:
                job[0] = job[2]
        self._reschedule()

    def resume(self) -> None:
        self._advance()
        self.paused = False
        self._reschedule()

    def _advance(self) -> None:
        dt = self.sim.now - self.at
        if dt > 0:
            for tid, job in self.jobs.items():
                job[0] -= self.rates.get(tid, 0.0) * dt
        self.at = self.sim.now

    def _reschedule(self) -> None:
        self.rates = {} if self.paused else water_fill(self.cap, {t: j[1] for t, j in self.jobs.items()})
        self.token += 1
        ends = [(max(0.0, j[0]) / self.rates[t], t) for t, j in self.jobs.items() if self.rates.get(t, 0) > 0]
        if ends:
            dt, tid = min(ends)
            self.sim.at(self.sim.now + dt, self._done, self.token, tid)

    def _done(self, token: int, tid: str) -> None:
        if token != self.token or tid not in self.jobs:
            return  # the shares changed since: a later event stands for it
        self._advance()
        del self.jobs[tid]
        self._reschedule()
        self.sim.resume(tid)


def water_fill(capacity: float, tops: dict[str, float]) -> dict[str, float]:
    """Share ``capacity`` equally, none above its own top rate; what the capped leave goes to the rest."""
    rates, left, todo = {}, capacity, sorted(tops.items(), key=lambda kv: kv[1])
    while todo:
        share = left / len(todo)
        tid, top = todo[0]
        if top <= share:
            rates[tid] = top
            left -= top
            todo.pop(0)
        else:
            for tid, _ in todo:
                rates[tid] = share
            break
    return rates


class Barrier:
    """Batch level: every member of a wave starts turn k's generate when all still running have reached it."""

    def __init__(self):
        self.parties, self.waiting = 0, []

    def arrive(self, sim: "object", tid: str) -> None:
        self.waiting.append(tid)
        self._release(sim)

    def leave(self, sim: "object", tid: str) -> None:
        self.parties -= 1
        if tid in self.waiting:
            self.waiting.remove(tid)
        self._release(sim)

    def _release(self, sim: "object") -> None:
        if self.waiting and len(self.waiting) >= self.parties:
            out, self.waiting = self.waiting, []
            for tid in out:
                sim.at(sim.now, sim.resume, tid)
