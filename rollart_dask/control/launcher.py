"""Launching trajectories: admission under the staleness bound, one coroutine per trajectory, and
carrying out the buffer's orders (relaunch a lost member, cancel stale or redundant ones).

Admission: ``safe`` opens a group only while groups admitted < (engine version + α + 1) × batch, so
nothing is started that the staleness bound would certainly throw away; α = 0 then waits for each
training step and its weight update before rollout goes on. ``eager`` (the paper's) keeps up to
(α + 1) batches untrained, in flight or ready; what outlives the bound is aborted.
Levels: ``trajectory`` opens groups one by one as room appears; ``batch`` opens a whole wave of
batch_groups groups whose turns advance in lock-step (a TurnBarrier), the synchronous baseline.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter

from rollart_dask.algo.seeding import mixed_seed
from rollart_dask.config import FlowConfig, TaskConfig
from rollart_dask.control import phases
from rollart_dask.control.breaker import FaultBreaker, UserCodeFailed
from rollart_dask.control.buffer import Orders, SampleBuffer
from rollart_dask.control.dispatch import WorkerLost
from rollart_dask.control.envmanager import EnvManager, TurnBarrier
from rollart_dask.control.proxy import LLMProxy, TrajectoryCancelled
from rollart_dask.observe import console
from rollart_dask.types import Trajectory


def admission_limit(rollout, groups_trained: int, versions: int) -> int:
    """Groups that may have been admitted once ``groups_trained`` have trained and the engines installed ``versions``
    since rollout began: eager admission counts trained groups, the rest the engines' versions (the module docstring).
    Pure: the policy simulator (emulation/simulate.py) admits by it too."""
    r = rollout
    if r.admission == "eager" and r.alpha > 0:
        return groups_trained + (r.alpha + 1) * r.batch_groups
    return (versions + r.alpha + 1) * r.batch_groups


def draw_group(rng: random.Random, tasks: dict, start_seed: int) -> tuple[str, int]:
    """A new group's task (by weight) and env seed (below the held-out range), from the run's generator. Pure: the
    policy simulator draws by it too, from a generator seeded alike, so it launches the measured run's task sequence."""
    names = list(tasks)
    task = rng.choices(names, weights=[tasks[n].weight for n in names])[0]
    return task, rng.randrange(0, start_seed)


class Launcher:
    def __init__(self, cfg: FlowConfig, buffer: SampleBuffer, proxy: LLMProxy, em: EnvManager, counts: Counter, on_fatal=None):
        self.cfg, self.buffer, self.proxy, self.em, self.counts = cfg, buffer, proxy, em, counts
        self.tasks = {t.name: t for t in cfg.tasks}
        self.rng = random.Random(cfg.seed)
        self.members: dict[str, asyncio.Task] = {}  # trajectory id → its coroutine
        self.base_version = 0  # admission counts groups from the version rollout started at
        self.paused = False
        self.stopping = False
        self.rollout_span: dict | None = None  # Dask span every trajectory's calls go into
        self.finished_at = time.monotonic()  # when a trajectory last finished (the watchdog's progress)
        self.trajectory_s: list[float] = []  # launch → reward of trajectories finished since the last drain
        self.batch_ready = asyncio.Event()  # a trajectory ended: a batch may be complete
        self._wake = asyncio.Event()
        self._wave: list[str] = []
        f = cfg.rollout.user_faults
        self.breaker = FaultBreaker(f.consecutive, f.share, f.window)  # a task whose own code keeps failing stops the run
        self.on_fatal = on_fatal  # the run's fail(error)

    def wake(self) -> None:
        self._wake.set()

    def limit(self) -> int:
        """Groups that may have been admitted so far (see the module docstring)."""
        return admission_limit(self.cfg.rollout, self.buffer.counts["groups_trained"], self.proxy.version - self.base_version)

    async def loop(self) -> None:
        r = self.cfg.rollout
        while not self.stopping:
            if self.paused:
                pass
            elif r.level == "trajectory":
                while self.buffer.admitted < self.limit() and not self.stopping and not self.paused:
                    self._open_group(None)
            elif self._wave_done() and self.buffer.admitted + r.batch_groups <= self.limit():
                barrier = TurnBarrier(0)  # each opened group adds its members
                self._wave = [self._open_group(barrier) for _ in range(r.batch_groups)]
            self._wake.clear()
            await self._wake.wait()

    def _open_group(self, barrier: TurnBarrier | None) -> str:
        task, seed = draw_group(self.rng, self.tasks, self.cfg.eval.start_seed)
        gid = f"g{self.buffer.opened}-{uuid.uuid4().hex[:6]}"
        size = self.tasks[task].group_size or self.cfg.rollout.group_size
        if barrier is not None:
            barrier.parties += size + self.cfg.rollout.redundancy
        self.carry_out(self.buffer.open_group(gid, task, seed, size), barrier)
        return gid

    def _wave_done(self) -> bool:
        return all(g not in self.buffer.groups or not self.buffer.groups[g].running() for g in self._wave)

    def carry_out(self, orders: Orders, barrier: TurnBarrier | None = None) -> None:
        for gid, tid in orders.launch:
            g = self.buffer.groups[gid]
            traj = Trajectory(id=tid, group_id=gid, task=g.task, seed=g.seed)
            if self.cfg.rollout.deterministic:  # its tokens' seeds: the run's seed, the group's launch ordinal, its index
                traj.sampling_seed = mixed_seed(self.cfg.seed, g.ordinal, g.member_index(tid))
            member = self.members[tid] = asyncio.ensure_future(self._member(traj, self.tasks[g.task], barrier))
            # on the task, not in the coroutine: a member cancelled before its first step never runs its body
            member.add_done_callback(lambda _, tid=tid: self._member_ended(tid))
        if orders.cancel:
            asyncio.ensure_future(self._cancel(orders.cancel))
            for tid in orders.cancel:
                task = self.members.get(tid)
                if task is not None:
                    task.cancel()
        self.wake()  # what the buffer did may have dropped a group: room to admit another

    def _member_ended(self, tid: str) -> None:
        self.members.pop(tid, None)
        self.batch_ready.set()
        self._wake.set()

    async def _cancel(self, traj_ids: list[str]) -> None:
        """Abort the engine requests of cancelled trajectories; a failed abort is counted (the request
        then runs to its end and its answer is dropped), and ignored once the run is stopping."""
        try:
            await self.proxy.cancel(traj_ids)
        except Exception:
            if not self.stopping:
                self.counts["abort_errors"] += 1

    async def _member(self, traj: Trajectory, task: TaskConfig, barrier: TurnBarrier | None) -> None:
        orders = Orders()
        t0 = time.monotonic()
        try:
            # a member started from inside a phase (a replacement) still counts as rollout, not as that phase
            with phases.within(self.rollout_span):
                await self.em.run(traj, task, barrier, on_start=self.buffer.started)
            traj.finished_version, traj.finished_at = self.proxy.version, time.monotonic()
            orders = self.buffer.finished(traj)
            self.trajectory_s.append(time.monotonic() - t0)
            self.counts["turns"] += len(traj.turns)
            self.finished_at = time.monotonic()  # only a finished trajectory is progress, not a failure
        except (TrajectoryCancelled, asyncio.CancelledError):
            return  # the buffer ordered it and counted it
        except WorkerLost:
            orders = self.buffer.failed(traj.id, "worker_lost")
        except Exception as e:
            reason = f"failed_{type(e).__name__}"
            if self.counts[reason] < 3:  # (the first line: a user's traceback comes whole in the error that stops the run)
                console.print(f"trajectory {traj.id} ({traj.task}) failed: {str(e).splitlines()[0]}", markup=False, style="yellow")
            self.counts[reason] += 1
            orders = self.buffer.failed(traj.id, "failed")
            if isinstance(e, UserCodeFailed):
                self.counts[f"user_faults_{e.call}"] += 1
                fault = self.breaker.failed(e, traj.group_id)
                if fault is not None and self.on_fatal is not None:
                    self.on_fatal(fault)
        else:
            self.breaker.ok(traj.task, traj.group_id)
        self.carry_out(orders)

    def drain_trajectory_s(self) -> dict:
        """Rollout time of the trajectories finished since the last call: n, mean, p50, p99."""
        xs, self.trajectory_s = sorted(self.trajectory_s), []
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))]}

    async def stop(self) -> None:
        self.stopping = True
        self._wake.set()
        members = list(self.members.values())
        for t in members:
            t.cancel()
        await asyncio.gather(*members, return_exceptions=True)
