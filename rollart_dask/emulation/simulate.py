"""A discrete-event simulation of the runtime's policy on an emulated flow, with a runtime that costs nothing.

The real SampleBuffer (control/buffer.py: groups, redundancy, replacements, the staleness bound) is driven by
simulated events: admission as the Launcher does it (eager or by version, waves with a turn barrier at batch
level), the protocol as Run.step does it (Get Batch after the previous Train published, Suspend/Update/Resume
when a newer version is out, Train one at a time; α = 0 waits for its own Train), and calls that take exactly
their service time. So an ablation reports three numbers per variant: measured (the real runtime), simulated
(this: the policy alone) and the ideal (flow_ideal: bounds no policy of that kind beats). Runtime cost =
measured − simulated; policy limit = simulated − ideal.

Service times come from the models the ideal uses:
- env.reset / env.step / failures and retries: ``flow_ideal.env_times`` (the injection spec, ``rollout.retries``,
  calls cut at ``rollout.env_timeout_s``); envs never wait for a host (the env host has a thread per env);
- generation: each turn needs *work* — instance-seconds at the throughput-optimal batch (``per_trajectory_seconds``,
  spread over the turns by their batch-1 latencies) — and cannot finish faster than alone (its batch-1 latency);
  a pool's instances are shared among the turns generating on it (processor sharing, water-filled up to each
  turn's own top speed). Suspend aborts the turns in flight; they start again, from nothing, at Resume (or go on
  from where they were with ``rollout.partial: continue``);
- rollout.pd: a turn's prefill is work on the prefill pool (the prefill part of that work, latency the prefill's), then
  its whole prompt's KV crosses ``emulation.kv_link_gbps`` (a wait), then the decode is work on the decode pool;
- reward: serverless at once (its cost ``reward_s``), local on ``reward_slots`` servers in arrival order;
- train: ``train_step_seconds`` of the batch's tokens; update: ``weight_load_seconds`` of the slowest instance, after
  the cross-cluster transfer (``weight_transfer_seconds``): pulled in the background from the publish on, or inside
  the pause with ``weights.pull: at_update``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from rollart_dask.envs.synthetic import draw_length
from rollart_dask.config import task_pools
from rollart_dask.control.buffer import SampleBuffer
from rollart_dask.control.fairness import length_shift
from rollart_dask.control.launcher import admission_limit, draw_group
from rollart_dask.emulation.flow_ideal import _generation_latency, _generation_parts, _pools, env_calls, task_loads, transfer_seconds
from rollart_dask.emulation.hardware import GPUS, MODELS, kv_transfer_seconds, train_step_seconds, weight_load_seconds
from rollart_dask.emulation.ideal import per_trajectory_parts
from rollart_dask.emulation.sharing import Barrier, SharedPool
from rollart_dask.types import Trajectory


PROBE_S = 1.0  # emulated seconds between samples of which tasks hold admission (open groups)


@dataclass
class SimResult:
    step_s: float  # mean emulated seconds between Train completions after the warm-up steps
    throughput: float  # trained trajectories per emulated second
    rollout_s: float | None  # mean launch → reward of the trajectories that finished
    trained_mix: dict[str, float]  # share of the groups trained per task in the measured steps (after warm-up + 1)
    counts: dict = field(default_factory=dict)  # the buffer's counts (aborted_stale, evicted_stale, groups_dropped, …)
    held_mix: dict[str, float] = field(default_factory=dict)  # time-averaged share of the open groups per task
    mix_shift_pp: float = 0.0  # the largest gap between a task's launched and trained shares, as the last batch was taken
    length_shift_pp: float = 0.0  # within tasks, the largest gap of trained shares over the launched lengths' quartiles
    train_done_at: list[float] = field(default_factory=list)
    trained_by_step: list[dict[str, int]] = field(default_factory=list)  # groups trained per task, step by step


class Simulation:
    def __init__(self, cfg, engine_workers: dict[str, int], reward_slots: int | None, seed: int = 0):
        self.cfg, self.r = cfg, cfg.rollout
        self.model = MODELS[cfg.emulation.model]
        self.loads = {t.name: t for t in task_loads(cfg)}
        self.tasks = {t.name: t for t in cfg.tasks}
        pools = _pools(cfg, engine_workers)
        self.pool_specs = pools
        self.pd = cfg.rollout.pd_route  # (auto: the placement predictor sets each candidate's)
        self.pools = {p: SharedPool(self, pool.instances, keep_partial=self.r.partial == "continue") for p, pool in pools.items()}
        self.reward_slots = reward_slots
        self.rng, self.py = np.random.default_rng(seed), random.Random(seed)
        self.task_rng = random.Random(cfg.seed)  # the launcher's: every seed launches the measured run's task sequence
        self.timeout_s = self.r.env_timeout_s / cfg.emulation.time_scale if cfg.emulation.time_scale > 0 else float("inf")
        self.update_s = max(weight_load_seconds(self.model, p.gpu, p.tp) for p in pools.values())
        self.pull, self.transfer_s = cfg.weights.pull, transfer_seconds(cfg, engine_workers)
        self.staged_at = 0.0  # pull=background: when the engines hold the latest published version
        self.buffer = SampleBuffer(
            self.r.group_size, self.r.redundancy, max(self.r.alpha, 0), self.r.max_relaunch, self.r.fairness, self.r.lag_bound
        )
        self.now, self._events, self._seq = 0.0, [], itertools.count()
        self.procs: dict[str, object] = {}  # trajectory → its generator
        self.where: dict[str, str] = {}  # trajectory → the pool it generates on
        self.barrier_of: dict[str, Barrier] = {}
        self.started_at: dict[str, float] = {}
        self.rollout_s: list[float] = []
        self.reward_free: list[float] = [0.0] * (reward_slots or 0)
        self.engine_version = self.published = 0
        self.training = False
        self.trained_groups: list[Counter] = []  # per step, groups trained per task
        self.train_done_at: list[float] = []
        self.wave: list[str] = []
        self.version_of: dict[str, int] = {}  # trajectory → engine version at its first generate
        self.length_of: dict[str, float] = {}  # trajectory → emulated seconds it takes alone (drawn at launch, aborted ones too)
        self.trained_length: dict[str, list[float]] = {}  # task → lengths of the trained trajectories
        self._task_of: dict[str, str] = {}
        self._work_of: dict[tuple, float] = {}
        self._loop = None
        self.held: Counter = Counter()  # task → open groups summed over the probes (every PROBE_S emulated s)
        self._next_probe = 0.0

    # -- the event loop ------------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, steps: int, horizon_s: float = 1e7, events_per_finish: int = 100_000) -> None:
        self._loop = self._protocol(steps)
        self.at(0.0, self._step_loop)
        self.at(0.0, self.admit)
        n, finished = 0, 0
        while self._loop is not None:
            if not self._events:
                raise RuntimeError(f"the simulated policy stalled after {len(self.train_done_at)} of {steps} steps: nothing left to happen")
            t, _, fn, args = heapq.heappop(self._events)
            n += 1
            if self.buffer.counts["finished"] > finished:
                n, finished = 0, self.buffer.counts["finished"]
            if t > horizon_s or n > events_per_finish:  # e.g. every trajectory failing: groups dropped and reopened for ever
                raise RuntimeError(
                    f"the simulated policy made no step: no trajectory finished in {n} events ({t:.0f} emulated s); "
                    f"{len(self.train_done_at)} of {steps} steps, buffer {dict(self.buffer.counts)}"
                )
            while self._next_probe <= t:  # the state holds between events: sample it at the probe times passed
                self.held.update(g.task for g in self.buffer.groups.values())
                self._next_probe += PROBE_S
            self.now = t
            fn(*args)

    def resume(self, tid: str, value=None) -> None:
        proc = self.procs.get(tid)
        if proc is None:
            return  # cancelled meanwhile
        try:
            op = proc.send(value)
        except StopIteration:
            return
        kind = op[0]
        if kind == "wait":
            self.at(self.now + op[1], self.resume, tid)
        elif kind == "gen":
            self.where[tid] = op[1]
            self.pools[op[1]].add(tid, op[2], op[3])
        elif kind == "barrier":
            op[1].arrive(self, tid)
        elif kind == "reward":
            if self.reward_slots:  # local: the first free server, in arrival order
                i = min(range(len(self.reward_free)), key=self.reward_free.__getitem__)
                start = max(self.now, self.reward_free[i])
                self.reward_free[i] = start + op[1]
                self.at(start + op[1], self.resume, tid)
            else:
                self.at(self.now + op[1], self.resume, tid)

    # -- trajectories --------------------------------------------------------------------------------
    def _trajectory(self, gid: str, tid: str, task: str):
        load, t = self.loads[task], self.tasks[task]
        w = load.workload
        reset, steps, fail_at = env_calls(t.inject, self.rng, 1, w.turns, self.r.retries, self.timeout_s)
        fail_at = int(fail_at[0])
        outs = np.array([[draw_length(load.env_args.get("output_tokens", 256), self.py) for _ in range(w.turns)]])
        if self.pd is not None:
            ops, gen_s = self._pd_turns(task, outs)
        else:
            pools = [p for p in task_pools(t) if p in self.pools]
            pool = min(pools, key=lambda p: (len(self.pools[p].jobs) / self.pools[p].cap, p))
            latency = _generation_latency(load, self.model, self.pool_specs[pool], outs)[0]
            work = self._work(task, pool) * latency / max(latency.sum(), 1e-12)
            ops, gen_s = [[("gen", pool, float(work[k]), float(latency[k]))] for k in range(w.turns)], float(latency.sum())
        self.length_of[tid] = float(reset[0] + steps[0].sum() + gen_s + load.reward_s)
        barrier = self.barrier_of.get(tid)
        yield ("wait", float(reset[0]))
        if fail_at == 0:  # the reset failed, its retries too
            self._end(tid, failed=True)
            return
        for k in range(w.turns):
            if barrier is not None:
                yield ("barrier", barrier)
            if k == 0:
                self.buffer.started(tid, self.engine_version)
                self.version_of[tid] = self.engine_version
            for op in ops[k]:  # one generation, or (rollout.pd) prefill, KV transfer, decode
                yield op
                self.where.pop(tid, None)
            yield ("wait", float(steps[0, k]))
            if fail_at == k + 1:  # a failed step fails the trajectory (no retry: env.step is not idempotent)
                self._end(tid, failed=True)
                return
        b = self.barrier_of.pop(tid, None)
        if b is not None:  # out of the turns: the wave no longer waits for it
            b.leave(self, tid)
        yield ("reward", load.reward_s)
        self._end(tid, failed=False, gid=gid)

    def _pd_turns(self, task: str, outs: np.ndarray) -> tuple[list[list[tuple]], float]:
        """rollout.pd: each turn's prefill on the prefill pool (its share of the prefill work), the KV cache of its whole
        prompt across ``emulation.kv_link_gbps``, the decode on the decode pool; and the trajectory's generation alone."""
        load, (pf, dc) = self.loads[task], (self.pd.prefill, self.pd.decode)
        w = load.workload
        p_lat = _generation_parts(load, self.model, self.pool_specs[pf], outs)[0]
        d_lat = _generation_parts(load, self.model, self.pool_specs[dc], outs)[1][0]
        p_work = self._work(task, pf, phase=0) * p_lat / max(p_lat.sum(), 1e-12)
        d_work = self._work(task, dc, phase=1) * d_lat / max(d_lat.sum(), 1e-12)
        kv = [kv_transfer_seconds(self.model, w.prompt_at(k), self.cfg.emulation.kv_link_gbps) for k in range(w.turns)]
        ops = [
            [("gen", pf, float(p_work[k]), float(p_lat[k])), ("wait", kv[k]), ("gen", dc, float(d_work[k]), float(d_lat[k]))]
            for k in range(w.turns)
        ]
        return ops, float(p_lat.sum() + d_lat.sum() + sum(kv))

    def _work(self, task: str, pool: str, phase: int | None = None) -> float:
        """Instance-seconds of one trajectory at the batch the pool holds when the policy keeps it full: the
        trajectories admission lets be in flight at once, shared by the instances (at most what their KV holds)."""
        key = (task, pool, phase)  # phase (rollout.pd): 0 the prefill's work alone, 1 the decode's
        if key not in self._work_of:
            r, w = self.r, self.loads[task].workload
            in_flight = sum(t.n for t in self.loads.values()) * ((r.alpha + 1) if r.level == "trajectory" else 1)
            parts = per_trajectory_parts(replace(w, trajectories=max(1, round(in_flight))), self.model, self.pool_specs[pool])
            self._work_of[key] = sum(parts) if phase is None else parts[phase]
        return self._work_of[key]

    def _end(self, tid: str, failed: bool, gid: str | None = None) -> None:
        self.procs.pop(tid, None)
        b = self.barrier_of.pop(tid, None)
        if b is not None:
            b.leave(self, tid)
        if failed:
            self._carry_out(self.buffer.failed(tid, "failed"))
        else:
            traj = Trajectory(id=tid, group_id=gid, task=self._task_of[tid], seed=0, version=self.version_of.get(tid, 0))
            self.rollout_s.append(self.now - self.started_at.pop(tid))
            self._carry_out(self.buffer.finished(traj))
        self.at(self.now, self.admit)
        self.at(self.now, self._step_loop)

    def _launch(self, gid: str, tid: str, barrier: Barrier | None) -> None:
        task = self.buffer.groups[gid].task
        self._task_of[tid] = task
        if barrier is not None:
            barrier.parties += 1
            self.barrier_of[tid] = barrier
        self.started_at[tid] = self.now
        self.procs[tid] = self._trajectory(gid, tid, task)
        self.resume(tid)

    def _cancel(self, tid: str) -> None:
        if self.procs.pop(tid, None) is None:
            return
        self.started_at.pop(tid, None)
        pool = self.where.pop(tid, None)
        if pool is not None:
            self.pools[pool].remove(tid)
        b = self.barrier_of.pop(tid, None)
        if b is not None:
            b.leave(self, tid)

    def _carry_out(self, orders, barrier: Barrier | None = None) -> None:
        for tid in orders.cancel:
            self._cancel(tid)
        for gid, tid in orders.launch:
            self._launch(gid, tid, barrier)

    # -- admission (control/launcher.py) -------------------------------------------------------------
    def limit(self) -> int:
        return admission_limit(self.r, self.buffer.counts["groups_trained"], self.engine_version)

    def admit(self) -> None:
        r = self.r
        if r.level == "trajectory":
            while self.buffer.admitted < self.limit():
                self._open_group(None)
        elif self._wave_done() and self.buffer.admitted + r.batch_groups <= self.limit():
            barrier = Barrier()
            self.wave = [self._open_group(barrier) for _ in range(r.batch_groups)]

    def _wave_done(self) -> bool:
        return all(g not in self.buffer.groups or not self.buffer.groups[g].running() for g in self.wave)

    def _open_group(self, barrier: Barrier | None) -> str:
        task, _ = draw_group(self.task_rng, self.tasks, self.cfg.eval.start_seed)
        gid = f"g{self.buffer.opened}"
        size = self.tasks[task].group_size or self.r.group_size
        self._carry_out(self.buffer.open_group(gid, task, 0, size), barrier)
        return gid

    # -- the protocol (control/run.py) ---------------------------------------------------------------
    def _step_loop(self) -> None:
        if self._loop is None:
            return
        try:
            next(self._loop)
        except StopIteration:
            self._loop = None

    def _protocol(self, steps: int):
        """Yields whenever it waits; woken by every trajectory's end and every Train's."""
        B = self.r.batch_groups
        for _ in range(steps):
            while self.training:  # Get Batch: the previous Train must have published
                yield
            while True:
                self._carry_out(self.buffer.enforce_staleness(self.published))
                groups = self.buffer.take(B)
                if groups is not None:
                    break
                yield
            self.at(self.now, self.admit)
            yield from self._install()
            self.trained_groups.append(Counter(g.task for g in groups))
            for g in groups:
                self.trained_length.setdefault(g.task, []).extend(self.length_of[t.id] for t in g.kept)
            tokens = sum(self.loads[g.task].workload.sample_tokens for g in groups for _ in g.kept)
            e = self.cfg.emulation
            train_s = train_step_seconds(self.model, e.trainer.gpus, int(tokens), GPUS[e.trainer.gpu])
            self.training = True
            self.at(self.now + train_s, self._trained)
            if self.r.alpha == 0:
                while self.training:
                    yield
                yield from self._install()
        while self.training:  # the last Train's step ends when it publishes
            yield

    def _install(self):
        """Suspend → Update → Resume when a newer version is published (generation paused for the swap); the
        background pull must have ended first, a pull at update happens inside the pause."""
        if self.published <= self.engine_version:
            return
        if self.pull == "background" and self.now < self.staged_at:
            self.at(self.staged_at, self._step_loop)
            while self.now < self.staged_at:
                yield
        for pool in self.pools.values():
            pool.pause()
        swapped = self.now + self.update_s + (self.transfer_s if self.pull == "at_update" else 0.0)
        self.at(swapped, self._step_loop)
        while self.now < swapped:  # (trajectories ending meanwhile wake the loop too)
            yield
        self.engine_version = self.published
        for pool in self.pools.values():
            pool.resume()
        self._carry_out(self.buffer.enforce_staleness(self.published))
        self.at(self.now, self.admit)

    def _trained(self) -> None:
        self.training = False
        self.published += 1
        self.staged_at = self.now + self.transfer_s  # (background: the engines pull it meanwhile)
        self.train_done_at.append(self.now)
        self._step_loop()

    def result(self, warmup: int) -> SimResult:
        done = self.train_done_at[warmup:]
        gaps = np.diff(done)
        if not len(gaps):
            raise RuntimeError(f"the simulation trained {len(self.train_done_at)} steps: need warm-up ({warmup}) + 2")
        step_s = float(gaps.mean())
        n = self.r.batch_groups * self.r.group_size
        # the steps a measurement's mix counts (tools/ablation/measure.py: those whose Train ends a measured gap)
        trained = sum(self.trained_groups[warmup + 1 :], Counter())
        total, held = sum(trained.values()) or 1, sum(self.held.values()) or 1
        return SimResult(
            step_s,
            n / step_s,
            float(np.mean(self.rollout_s)) if self.rollout_s else None,
            {k: v / total for k, v in sorted(trained.items())},
            dict(self.buffer.counts),
            {k: v / held for k, v in sorted(self.held.items())},
            self.buffer.mix_at_take["shift_pp"],
            self._length_shift(),
            list(self.train_done_at),
            [dict(c) for c in self.trained_groups],
        )

    def _length_shift(self) -> float:
        launched: dict[str, list[float]] = {}
        for tid, x in self.length_of.items():
            launched.setdefault(self._task_of[tid], []).append(x)
        return length_shift(launched, self.trained_length)


def simulate(
    cfg, engine_workers: dict[str, int], reward_slots: int | None, steps: int | None = None, warmup: int = 2, seed: int = 0
) -> SimResult:
    """The flow's policy on its emulated workload with a zero-cost runtime (emulated seconds)."""
    sim = Simulation(cfg, engine_workers, reward_slots, seed)
    sim.run(steps if steps is not None else cfg.trainer.steps)
    return sim.result(warmup)
