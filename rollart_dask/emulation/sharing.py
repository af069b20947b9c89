"""What the policy simulator (simulate.py) shares among trajectories: an engine pool's instances, shared among the
turns generating on it (processor sharing: each turn at most as fast as it would run alone), and the turn barrier
of batch-level rollout. They call back into the simulation (``sim.now``, ``sim.at``, ``sim.resume``)."""

from __future__ import annotations

import numpy as np


class SharedPool:
    """An engine pool's instances shared among the turns generating on it (processor sharing). The turns live in
    arrays (a slot each, reused) so that an event costs a few vectorised passes, not a Python loop over every turn in
    flight: at 16,384 trajectories in flight the loops made the simulation take longer than the run it stands for."""

    def __init__(self, sim: "object", instances: int, keep_partial: bool = False):
        self.sim, self.cap = sim, float(instances)
        self.keep_partial = keep_partial  # rollout.partial=continue: a turn Suspend interrupts keeps the work it has done
        self.jobs: dict[str, int] = {}  # trajectory → its slot
        self.names: list[str | None] = []  # slot → its trajectory
        self.left, self.top, self.full, self.rate = (np.zeros(0) for _ in range(4))  # work left, top rate, full work, rate
        self._free: list[int] = []
        self.at = 0.0
        self.token = 0
        self.paused = False

    def add(self, tid: str, work: float, latency: float) -> None:
        self._advance()
        if not self._free:  # twice the slots (a free slot holds no work and a top rate of 0: it takes no share)
            n = len(self.left)
            self.left, self.top, self.full, self.rate = (
                np.concatenate([a, np.zeros(max(n, 64))]) for a in (self.left, self.top, self.full, self.rate)
            )
            self._free = list(range(len(self.left) - 1, n - 1, -1))
            self.names += [None] * (len(self.left) - n)
        i = self.jobs[tid] = self._free.pop()
        self.names[i] = tid
        self.left[i], self.top[i], self.full[i] = work, work / latency if latency > 0 else float("inf"), work
        self._reschedule()

    def remove(self, tid: str) -> None:
        if tid in self.jobs:
            self._advance()
            self._release(tid)
            self._reschedule()

    def pause(self) -> None:
        """Suspend: every turn in flight is aborted; at Resume it starts again from nothing (restart) or goes on from
        where it was (continue; the re-prefill of its prefix is not modelled)."""
        self._advance()
        self.paused = True
        if not self.keep_partial:
            self.left[:] = self.full
        self._reschedule()

    def resume(self) -> None:
        self._advance()
        self.paused = False
        self._reschedule()

    def _release(self, tid: str) -> None:
        i = self.jobs.pop(tid)
        self.left[i] = self.top[i] = self.full[i] = self.rate[i] = 0.0
        self.names[i] = None
        self._free.append(i)

    def _advance(self) -> None:
        dt = self.sim.now - self.at
        if dt > 0 and self.jobs:
            self.left -= self.rate * dt
        self.at = self.sim.now

    def _reschedule(self) -> None:
        self.token += 1
        if self.paused or not self.jobs:
            self.rate[:] = 0.0
            return
        self.rate = np.minimum(self.top, fill_level(self.cap, self.top))
        moving = self.rate > 0
        if moving.any():
            ends = np.full(len(self.rate), np.inf)
            ends[moving] = np.maximum(self.left[moving], 0.0) / self.rate[moving]
            first = np.flatnonzero(ends == ends.min())  # several end at once (done, or nothing left): by name, as before
            i = int(first[0]) if len(first) == 1 else min(first, key=self.names.__getitem__)
            self.sim.at(self.sim.now + float(ends[i]), self._done, self.token, self.names[i])

    def _done(self, token: int, tid: str) -> None:
        if token != self.token or tid not in self.jobs:
            return  # the shares changed since: a later event stands for it
        self._advance()
        self._release(tid)
        self._reschedule()
        self.sim.resume(tid)


def fill_level(capacity: float, tops: np.ndarray) -> float:
    """The share each uncapped turn gets when ``capacity`` is shared equally and none runs above its top rate (what
    the capped leave goes to the rest): the rates are ``min(top, level)``; inf when every turn runs at its top."""
    s = np.sort(tops)
    # what is left before each turn once those below it run at their tops: subtracted one by one, in order (as a
    # loop would: the same rounding, so the simulation's events come in the same order)
    left = np.subtract.accumulate(np.concatenate(([capacity], s)))[:-1]
    share = left / np.arange(len(s), 0, -1)
    over = np.flatnonzero(s > share)
    return float(share[over[0]]) if len(over) else float("inf")


def water_fill(capacity: float, tops: dict[str, float]) -> dict[str, float]:
    """Share ``capacity`` equally, none above its own top rate; what the capped leave goes to the rest."""
    level = fill_level(capacity, np.array(list(tops.values()), dtype=float))
    return {t: min(top, level) for t, top in tops.items()}


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
