"""The ideal step time of an emulated flow: its workload (synthetic tasks, injected env latency,
reward cost), cluster (emulated pools) and mode, with zero scheduling overhead. Every ablation
reports its measured step time as a fraction of this.

Same assumptions as ``ideal`` (each term a lower bound), extended to a task mix:
- Per step, N = batch_groups × group size trajectories, split among tasks by weight.
- Rollout throughput T_thr: each task's trajectories cost instance-seconds on the pool it is
  pinned to (affinity) at the throughput-optimal batch; tasks with affinity ``auto`` are split
  between pools by comparative advantage (exact for two pools); the busiest pool sets T_thr.
- Latency: one trajectory alone (batch 1) on its pool: per turn the new tokens' prefill + its own
  output's decode steps, plus its env reset/steps and reward, sampled from the same distributions
  the workload draws from. By Jensen, using per-trajectory draws keeps it a lower bound.
- Staleness: a group started in step interval k runs on version k−1 and must be trained by version
  k−1+α, i.e. finish within α intervals — so with ``safe`` admission (no group ever aborted) a step
  lasts at least the batch's slowest group latency / α. ``eager`` admission aborts what outlives
  the bound instead, and admits at most (α+1) batches beyond those trained: ``eager_bound`` — a
  group launched at a uniform point u of an interval S is trainable only if it finishes within
  (α+1−u)·S, and an aborted one holds its admission until then, so S ≥ E[occupancy] / ((α+1)·P(trainable))
  (Little's law over trained groups). It also gives the mix eager can train at best: the
  trainable groups' tasks. With ``rollout.fairness: task`` every task trains at its launched share:
  each group holds admission for its latency at the launched mix (stale members relaunched).
- Reward capacity: serverless is unbounded; local rewards run ``slots`` at a time (the REWARD
  worker's task threads), so N × E[reward] / slots bounds the step from below.
- Env failures and hangs cost what they take until they fail, resets retried as the runtime does
  (``rollout.retries``, each call cut at ``rollout.env_timeout_s``); the replacement of a failed
  trajectory is not modelled, nor redundancy (it only removes tail time that failures and
  stragglers added), nor the train/rollout GPU contention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from rollart_dask.envs.inject import parse_spec
from rollart_dask.envs.synthetic import draw_length, length_mean

from rollart_dask.config import task_pools
from rollart_dask.emulation.hardware import (
    GPUS,
    MODELS,
    decode_step_seconds,
    prefill_seconds,
    train_step_seconds,
    weight_load_seconds,
    weight_transfer_seconds,
)
from rollart_dask.emulation.ideal import Ideal, Pool, Workload, per_trajectory_seconds


@dataclass
class TaskLoad:
    name: str
    n: float  # trajectories per step
    workload: Workload  # mean lengths
    pools: tuple[str, ...]  # pools it may generate on
    env_args: dict
    inject: dict | None
    reward_s: float  # emulated seconds per reward call
    group_size: int
    share: float  # probability a group is of this task (the launcher draws each group's task by weight)


def env_times(
    inject: dict | None, rng: np.random.Generator, n: int, turns: int, retries: int = 0, timeout_s: float = float("inf")
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the env calls of ``n`` trajectories cost (emulated seconds), drawn from the injection spec the way
    envs/inject.py plays it: reset (n) — every attempt's latency, a hung one's ``hang_s`` more (at most the call
    timeout), a failed one retried up to ``retries`` times with fresh draws —, steps (n × turns; a step that fails or
    hangs ends its trajectory: no retry, the later turns cost nothing) and whether each trajectory failed (n)."""
    reset, steps, fail_at = env_calls(inject, rng, n, turns, retries, timeout_s)
    return reset, steps, fail_at >= 0


def env_calls(
    inject: dict | None, rng: np.random.Generator, n: int, turns: int, retries: int = 0, timeout_s: float = float("inf")
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``env_times`` with where each trajectory failed: -1 not at all, 0 its reset, k + 1 its step of turn k."""
    reset, steps, failed = np.zeros(n), np.zeros((n, turns)), np.full(n, -1)
    if not inject:
        return reset, steps, failed
    spec = parse_spec({k: v for k, v in inject.items() if k != "time_scale"})
    hang_s = min(spec.hang_s, timeout_s)

    def call(latency, fail_p: float, hang_p: float) -> tuple[float, bool]:
        z, u, f, h = rng.standard_normal(), rng.random(), rng.random(), rng.random()
        t = latency.value(z, u)
        if h < hang_p:
            return min(t + hang_s, timeout_s), False
        return min(t, timeout_s), f >= fail_p

    for i in range(n):
        for _ in range(retries + 1):
            t, ok = call(spec.reset_latency, spec.reset_fail, spec.hang_of("reset"))
            reset[i] += t
            if ok:
                break
        else:
            failed[i] = 0
            continue
        for k in range(turns):
            steps[i, k], ok = call(spec.step_latency, spec.step_fail, spec.hang_of("step"))
            if not ok:
                failed[i] = k + 1
                break
    return reset, steps, failed


def task_loads(cfg) -> list[TaskLoad]:
    r = cfg.rollout
    weights = sum(t.weight for t in cfg.tasks)
    loads = []
    for t in cfg.tasks:
        if t.env != "synthetic":
            raise ValueError(f"the ideal is defined for emulated workloads: task {t.name} uses env {t.env!r}, not 'synthetic'")
        a = t.env_args
        groups = r.batch_groups * t.weight / weights
        turns = min(int(a.get("turns", 1)), t.max_turns)  # the runtime ends a trajectory at max_turns
        w = Workload(
            trajectories=max(1, round(groups * (t.group_size or r.group_size))),
            turns=turns,
            prompt_tokens=round(length_mean(a.get("prompt_tokens", 512))),
            output_tokens=max(1, round(length_mean(a.get("output_tokens", 256)))),
            obs_tokens=round(length_mean(a.get("obs_tokens", 64), minimum=0)) if turns > 1 else 0,
        )
        loads.append(
            TaskLoad(
                t.name,
                groups * (t.group_size or r.group_size),
                w,
                task_pools(t),
                a,
                t.inject,
                float(a.get("reward_s", 0.0)),
                t.group_size or r.group_size,
                t.weight / weights,
            )
        )
    return loads


def reward_slots(cfg) -> int | None:
    """Rewards scored at once: local = batches in flight on the REWARD workers, each scored in turn; serverless: unbounded."""
    if cfg.reward.mode == "serverless":
        return None
    return sum(min(w.nthreads, cfg.rollout.coalesce_inflight) for w in cfg.cluster.workers if "REWARD" in w.pools)


def _pools(cfg, engine_workers: dict[str, int]) -> dict[str, Pool]:
    e = cfg.emulation
    return {
        p: Pool(GPUS[e.pools[p].gpu], e.pools[p].gpus * k, e.pools[p].tp)
        for p, k in engine_workers.items()
        if k and p in e.pools and e.pools[p].gpus
    }


def transfer_seconds(cfg, engine_workers: dict[str, int]) -> float:
    """The emulated cross-cluster transfer of one version (``weights.pull``'s way) to the flow's engine workers."""
    e = cfg.emulation
    generation_gpus = sum(e.pools[p].gpus * k for p, k in engine_workers.items() if p in e.pools)
    return weight_transfer_seconds(MODELS[e.model], generation_gpus, e.trainer.gpus, e.weight_link_gbps, cfg.weights.pull)


def _throughput_bound(loads: list[TaskLoad], pools: dict[str, Pool], model) -> float:
    """Smallest T such that every pool's instance-seconds fit; auto tasks split by comparative advantage."""
    cost = {(t.name, p): per_trajectory_seconds(t.workload, model, pools[p]) for t in loads for p in t.pools if p in pools}
    for t in loads:
        if not any((t.name, p) in cost for p in t.pools):
            raise ValueError(f"task {t.name}: none of its pools {t.pools} has emulated GPUs")

    def fits(T: float) -> bool:
        cap = {p: T * pool.instances for p, pool in pools.items()}
        flexible = []
        for t in loads:
            usable = [p for p in t.pools if (t.name, p) in cost]
            if len(usable) == 1:
                cap[usable[0]] -= t.n * cost[t.name, usable[0]]
            else:
                flexible.append((t, usable))
        if len(pools) == 2 and flexible:  # fill the first pool with the tasks relatively cheapest there
            a, b = list(pools)
            flexible.sort(key=lambda tu: cost[tu[0].name, a] / cost[tu[0].name, b])
            for t, _ in flexible:
                on_a = max(0.0, min(t.n, cap[a] / cost[t.name, a]))
                cap[a] -= on_a * cost[t.name, a]
                cap[b] -= (t.n - on_a) * cost[t.name, b]
        else:
            for t, usable in flexible:
                cap[usable[0]] -= t.n * cost[t.name, usable[0]]
        return all(c >= -1e-9 for c in cap.values())

    lo, hi = 0.0, 1.0
    while not fits(hi):
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _generation_latency(t: TaskLoad, model, pool: Pool, outputs: np.ndarray) -> np.ndarray:
    """Batch-1 generation time per trajectory and turn (n × turns) given drawn output lengths."""
    prefill, decode = _generation_parts(t, model, pool, outputs)
    return prefill[None, :] + decode


def _generation_parts(t: TaskLoad, model, pool: Pool, outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_generation_latency`` as (prefill per turn, decode per trajectory and turn)."""
    w = t.workload
    prefill = np.array(
        [
            prefill_seconds(model, pool.gpu, w.prompt_tokens if k == 0 else max(1, w.obs_tokens), pool.tp, w.prompt_at(k))
            for k in range(w.turns)
        ]
    )
    mean_ctx = sum(w.prompt_at(k) for k in range(w.turns)) / w.turns
    per_token = decode_step_seconds(model, pool.gpu, 1, int(mean_ctx), pool.tp)
    return prefill, (outputs - 1).clip(min=0) * per_token


def _sample_latencies(
    loads: list[TaskLoad],
    pools: dict[str, Pool],
    model,
    samples: int,
    seed: int,
    batch_groups: int,
    retries: int = 0,
    timeout_s: float = float("inf"),
    batches: list[list[int]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per sample (a batch whose groups' tasks are drawn by weight, as the launcher does):
    trajectory-level makespan (slowest trajectory), batch-level makespan (a barrier before every
    generate), every group's latency — its slowest member's, as GRPO needs the whole group —, and
    the batch-level reset phase (the slowest member's reset, retries included), and the mean trajectory's
    latency (launch → reward: what a trajectory's rollout time cannot beat). Env failures cost
    the time until they fail (their replacements are not modelled: a lower bound). Last, each group's task."""
    rng, py = np.random.default_rng(seed), random.Random(seed)
    traj_max, wave, every, reset_wave = np.zeros(samples), np.zeros(samples), [], np.zeros(samples)
    traj_mean, group_task = np.zeros(samples), []
    fastest = [
        min(
            (pools[p] for p in t.pools if p in pools),  # alone, a trajectory takes its fastest pool
            key=lambda p, t=t: float(_generation_latency(t, model, p, np.full((1, t.workload.turns), t.workload.output_tokens)).sum()),
        )
        for t in loads
    ]
    for s in range(samples):
        resets, turns, rewards, groups = [], [], [], []
        counts = batches[s % len(batches)] if batches else rng.multinomial(batch_groups, [t.share for t in loads])
        for t, k, pool in zip(loads, counts, fastest):
            if not k:
                continue
            n, w = int(k) * t.group_size, t.workload
            outs = np.array([[draw_length(t.env_args.get("output_tokens", 256), py) for _ in range(w.turns)] for _ in range(n)])
            reset, steps, _ = env_times(t.inject, rng, n, w.turns, retries, timeout_s)
            resets.append(reset)
            turns.append(_generation_latency(t, model, pool, outs) + steps)
            rewards.append(np.full(n, t.reward_s))
            groups += [t.group_size] * int(k)
            group_task += [t.name] * int(k)
        width = max(x.shape[1] for x in turns)
        per_turn = np.concatenate([np.pad(x, ((0, 0), (0, width - x.shape[1]))) for x in turns])
        reset, reward = np.concatenate(resets), np.concatenate(rewards)
        lat = reset + per_turn.sum(1) + reward
        every.append([chunk.max() for chunk in np.split(lat, np.cumsum(groups)[:-1]) if len(chunk)])
        traj_max[s], traj_mean[s] = lat.max(), lat.mean()
        clock = reset_wave[s] = reset.max()  # batch level: every turn starts when the slowest member finished the last
        for k in range(width):
            clock += per_turn[:, k].max()
        wave[s] = clock + reward.max()
    return traj_max, wave, np.array([x for xs in every for x in xs]), reset_wave, traj_mean, np.array(group_task)


PHASES = 64  # launch phases within an interval, midpoints of a uniform grid


def eager_window(latencies: np.ndarray, alpha: int, S: float) -> tuple[float, np.ndarray]:
    """At step time S under eager admission (α+1 batches admitted beyond those trained), a group launched at phase u of
    its interval is trainable only if its latency ℓ ≤ w = (α+1−u)·S, and an aborted one holds its admission until w.
    Returns the step time that admission allows then, E[min(ℓ, w)] / ((α+1)·P(ℓ ≤ w)) (Little's law over trained
    groups), and each group's chance of being trainable."""
    lat = np.asarray(latencies, dtype=float)[:, None]
    w = (alpha + 1 - (np.arange(PHASES) + 0.5) / PHASES)[None, :] * S
    ok = lat <= w
    p = ok.mean()
    return (float(np.minimum(lat, w).mean()) / ((alpha + 1) * p) if p else float("inf")), ok.mean(1)


def eager_bound(latencies: np.ndarray, alpha: int) -> float:
    """The smallest step time S that eager admission allows itself: S ≥ eager_window(S) (bisection; at S = max ℓ / α
    every group fits any phase, and the window's demand falls as S grows)."""
    lo, hi = 0.0, float(np.max(latencies)) / alpha
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eager_window(latencies, alpha, mid)[0] <= mid else (mid, hi)
    return hi


def launched_batches(cfg) -> list[list[int]]:
    """Groups per task (in ``task_loads`` order) of each batch a run of ``cfg`` launches in turn — the launcher's own
    draws (control/launcher.draw_group, its generator seeded alike): the task sequence the measured run met."""
    from rollart_dask.control.launcher import draw_group

    rng, tasks = random.Random(cfg.seed), {t.name: t for t in cfg.tasks}
    names = [t.name for t in cfg.tasks]
    B = cfg.rollout.batch_groups
    seq = [draw_group(rng, tasks, cfg.eval.start_seed)[0] for _ in range(cfg.trainer.steps * B)]
    return [[seq[k * B : (k + 1) * B].count(n) for n in names] for k in range(cfg.trainer.steps)]


def flow_ideal(
    cfg,
    engine_workers: dict[str, int],
    reward_slots: int | None = None,
    samples: int = 200,
    seed: int = 0,
    batches: list[list[int]] | None = None,
) -> Ideal:
    """Ideal step time (emulated seconds) of an emulated flow on ``engine_workers`` (pool → engine
    workers). ``reward_slots``: concurrent local reward calls (None = serverless: unbounded). ``batches``: the task
    counts of the batches to sample (``launched_batches``: a run's own), cycled; None draws them from the weights."""
    r = cfg.rollout
    model = MODELS[cfg.emulation.model]
    pools = _pools(cfg, engine_workers)
    loads = task_loads(cfg)
    if batches:  # the run's own mix: every per-step load (throughput, train, reward) at the shares its batches had
        total = sum(map(sum, batches))
        shares = [sum(b[i] for b in batches) / total for i in range(len(loads))]
        loads = [replace(t, share=sh, n=r.batch_groups * sh * t.group_size) for t, sh in zip(loads, shares)]
    t_thr = _throughput_bound(loads, pools, model)
    timeout_s = r.env_timeout_s / cfg.emulation.time_scale if cfg.emulation.time_scale > 0 else float("inf")  # in emulated seconds
    traj_max, wave, every, reset_wave, traj_mean, group_task = _sample_latencies(
        loads, pools, model, samples, seed, r.batch_groups, r.retries, timeout_s, batches
    )
    lat_mean = float(every.mean())
    lat_max = float((wave if r.level == "batch" else traj_max).mean())
    n_total = sum(t.n for t in loads)
    reward_bound = sum(t.n * t.reward_s for t in loads) / reward_slots if reward_slots else 0.0
    makespan = max(t_thr, lat_max, reward_bound)
    tokens = sum(t.n * t.workload.sample_tokens for t in loads)
    e = cfg.emulation
    train = train_step_seconds(model, e.trainer.gpus, int(tokens), GPUS[e.trainer.gpu])
    update = max(weight_load_seconds(model, p.gpu, p.tp) for p in pools.values())
    if cfg.weights.pull == "at_update" or r.alpha == 0:  # the cross-cluster transfer inside the pause (or with nothing to hide
        # behind: synchronous training waits for it either way); background pulls may hide behind rollout: not counted
        update += transfer_seconds(cfg, engine_workers)
    alpha = r.alpha
    eager_mix, trainable = None, None  # eager admission: the mix it can train at best, and the share of groups trainable
    per_sample = np.maximum(np.maximum(wave if r.level == "batch" else traj_max, t_thr), reward_bound)  # one batch's makespan
    if alpha == 0:
        step_s, binding = makespan + update + train, "rollout+update+train"
        spread = per_sample
    elif r.level == "batch":  # one_off: the next wave's rollout overlaps this train
        step_s = max(makespan, train) + update
        binding = ("rollout" if makespan >= train else "train") + "+update"
        spread = np.maximum(per_sample, train)
    else:
        cands = {"rollout_throughput+update": t_thr + update, "train": train, "reward_capacity": reward_bound}
        if r.admission == "safe":  # no group is ever aborted: the slowest must fit the bound
            cands["group_latency/(alpha+1)"] = lat_mean / (alpha + 1)
            cands["staleness:slowest_group/alpha"] = float(traj_max.mean()) / alpha
        elif r.fairness == "task":  # fair eager: every task at its launched share, so every group holds admission for its
            # latency (Little's law at the launched mix); a member that outlives the bound is relaunched, not waited for
            cands["fair:group_latency/(alpha+1)"] = lat_mean / (alpha + 1)
        else:  # eager: what outlives its window is aborted, having held its admission until then
            cands["eager:trainable_groups"] = eager_bound(every, alpha)
        binding = max(cands, key=cands.get)
        step_s = cands[binding]
        spread = traj_max / alpha if binding.startswith("staleness") else np.zeros(1)
        if (
            r.admission == "eager" and r.fairness == "none"
        ):  # what can be trained at the bound's step time: the mix eager admission can reach at best
            trainable = eager_window(every, alpha, step_s)[1]
            eager_mix = {str(k): float(trainable[group_task == k].sum() / trainable.sum()) for k in sorted(set(group_task))}
    terms = {
        "staleness_bound_s": float(traj_max.mean()) / max(alpha, 1),
        "rollout_throughput_s": t_thr,
        "group_latency_mean_s": lat_mean,
        "reset_wave_s": float(reset_wave.mean()),
        "trajectory_latency_mean_s": float(traj_mean.mean()),
        "latency_max_s": lat_max,
        "makespan_s": makespan,
        "reward_capacity_s": reward_bound,
        "train_s": train,
        "update_s": update,
        "tokens_per_step": tokens,
        "trajectories_per_step": n_total,
        "trajectories_per_s": n_total / step_s,
        "alpha": alpha,
        "level": r.level,
        "step_sd_s": float(np.std(spread)),
        "eager_trainable_mix": eager_mix,
        "eager_trainable_share": None if trainable is None else float(trainable.mean()),
    }  # one step's spread: heavy tails make few-step means noisy
    return Ideal(r.mode, step_s, binding, terms)
