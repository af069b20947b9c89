"""Ideal step time: the best a workload can do on a cluster in a mode, with zero scheduling
overhead, so every measured step can be reported as a fraction of its own ideal.

Assumptions (each a lower bound, so ideal ≤ any real run of the same emulated hardware):
- Generation per trajectory on one engine instance (``tp`` GPUs): per turn, a prefill of the new
  tokens only (earlier turns are in the prefix cache) plus ``output − 1`` decode steps (the
  prefill yields the first token). Work is counted at the throughput-optimal batch
  B* = min(trajectories per instance, KV capacity / per-turn KV reservation): a decode token costs
  ``decode_step_seconds(B*, B* × mean context) / B*``; batched prefills cost their FLOPs.
- Rollout throughput bound T_thr: trajectories split across all generation instances in
  proportion to their rates (heterogeneous pools add up): T_thr = N / Σ_i (1 / gen_s_i).
- Latency bound of one trajectory, uncontended (batch 1): L = reset + Σ_turns (prefill + (out − 1)
  × decode step + env step) + reward. Env latencies are constants or capped lognormals.
- Batch makespan M (α = 0): max(T_thr, E[max over the N trajectories of L]) — trajectory level;
  batch level (a barrier every turn) pays E[max] of every turn's env step: Σ_turns E[max_i step_i].
  Expectations of maxima by Monte Carlo (seeded), exact for constants.
- Train: ``train_step_seconds(model, train GPUs, tokens)``, tokens = N × Σ_turns (prompt_k + out),
  i.e. per-turn samples as the runtime trains them. Update U: engines load new weights (host → HBM).
- Modes:   sync:     step = M + U + train
           one_off:  step = max(M, train) + U          (rollout k+1 overlaps train k)
           rollart α ≥ 1 (trajectory level, streaming):
                     step = max(T_thr + U, train, E[L] / (α + 1))
           (Little's law: at most (α + 1) × N trajectories in flight, each taking ≥ E[L].)
           rollart α = 0 is sync at its level.
- Not modelled: env/reward CPU capacity (unlimited), network, TP communication, preemption,
  prefill/decode disaggregation (simulate.py does), redundancy (which only helps against tails: use E[max] of the
  first G of G + r to model it later).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rollart_dask.emulation.hardware import (
    H800,
    GPUProfile,
    ModelProfile,
    decode_step_seconds,
    kv_capacity_tokens,
    prefill_flops,
    prefill_seconds,
    train_step_seconds,
    weight_load_seconds,
)


@dataclass(frozen=True)
class Latency:
    """Lognormal with the given median and shape ``sigma`` (0 = constant), capped at ``cap``."""

    median: float
    sigma: float = 0.0
    cap: float = math.inf

    def sample(self, rng: np.random.Generator, shape) -> np.ndarray:
        if self.sigma <= 0:
            return np.full(shape, min(self.median, self.cap))
        return np.minimum(self.median * np.exp(self.sigma * rng.standard_normal(shape)), self.cap)

    def mean(self, rng: np.random.Generator | None = None) -> float:
        if self.sigma <= 0 or math.isinf(self.cap):
            return min(self.median, self.cap) * math.exp(self.sigma**2 / 2)
        return float(self.sample(rng or np.random.default_rng(0), 100_000).mean())


def _lat(x) -> Latency:
    return x if isinstance(x, Latency) else Latency(float(x))


@dataclass(frozen=True)
class Workload:
    trajectories: int  # per training step (batch × group size)
    turns: int
    prompt_tokens: int  # first turn's prompt
    output_tokens: int  # per turn
    obs_tokens: int = 0  # new observation tokens appended each later turn
    env_reset: Latency | float = 0.0
    env_step: Latency | float = 0.0
    reward: Latency | float = 0.0

    def prompt_at(self, k: int) -> int:
        return self.prompt_tokens + k * (self.output_tokens + self.obs_tokens)

    @property
    def sample_tokens(self) -> int:
        """Tokens the trainer sees per trajectory: one sample per turn (prompt + response)."""
        return sum(self.prompt_at(k) + self.output_tokens for k in range(self.turns))


@dataclass(frozen=True)
class Pool:
    gpu: GPUProfile
    gpus: int
    tp: int = 1

    @property
    def instances(self) -> int:
        return self.gpus // self.tp


@dataclass(frozen=True)
class Cluster:
    model: ModelProfile
    generation: tuple[Pool, ...]
    train_gpus: int
    train_gpu: GPUProfile = H800
    update_s: float | None = None  # default: weight load of the slowest generation instance


@dataclass
class Ideal:
    mode: str
    step_s: float
    binding: str  # which term sets step_s
    terms: dict = field(default_factory=dict)

    def fraction(self, measured_step_s: float) -> float:
        """Measured result as a fraction of its ideal (1.0 = ideal; lower = slower)."""
        return self.step_s / measured_step_s if measured_step_s > 0 else 0.0


def per_trajectory_seconds(w: Workload, model: ModelProfile, pool: Pool) -> float:
    """Throughput view: instance-seconds one trajectory costs at the throughput-optimal batch."""
    return sum(per_trajectory_parts(w, model, pool))


def per_trajectory_parts(w: Workload, model: ModelProfile, pool: Pool) -> tuple[float, float]:
    """``per_trajectory_seconds`` as (prefill, decode): what each phase costs where prefill and decode are disaggregated."""
    reserve = max(w.prompt_at(k) + w.output_tokens for k in range(w.turns))
    per_instance = max(1, math.ceil(w.trajectories / max(1, pool.instances)))
    batch = max(1, min(per_instance, kv_capacity_tokens(model, pool.gpu, pool.tp) // reserve))
    mean_ctx = sum(w.prompt_at(k) + w.output_tokens / 2 for k in range(w.turns)) / w.turns
    per_token = decode_step_seconds(model, pool.gpu, batch, int(batch * mean_ctx), pool.tp) / batch
    prefill = 0.0
    for k in range(w.turns):
        new = w.prompt_tokens if k == 0 else max(1, w.obs_tokens)  # earlier prompt + response: prefix cache
        prefill += prefill_flops(model, new, w.prompt_at(k) - new) / (pool.tp * pool.gpu.peak_flops * pool.gpu.prefill_mfu)
    return prefill, w.turns * (w.output_tokens - 1) * per_token


def generation_latency(w: Workload, model: ModelProfile, pool: Pool) -> float:
    """Latency view: one trajectory's generation alone on an instance (batch 1)."""
    s = 0.0
    for k in range(w.turns):
        new = w.prompt_tokens if k == 0 else max(1, w.obs_tokens)
        s += prefill_seconds(model, pool.gpu, new, pool.tp, w.prompt_at(k) - new)
        for j in range(1, w.output_tokens):
            s += decode_step_seconds(model, pool.gpu, 1, w.prompt_at(k) + j, pool.tp)
    return s


def ideal_step(
    w: Workload, c: Cluster, mode: str = "sync", alpha: int = 0, level: str = "trajectory", samples: int = 200, seed: int = 0
) -> Ideal:
    if mode not in ("sync", "one_off", "rollart"):
        raise ValueError(f"mode must be sync, one_off or rollart, not {mode!r}")
    if mode == "sync":
        alpha, level = 0, "batch"
    elif mode == "one_off":
        alpha, level = 1, "batch"
    rng = np.random.default_rng(seed)
    pools = [p for p in c.generation if p.instances > 0]
    rate = sum(p.instances / per_trajectory_seconds(w, c.model, p) for p in pools)
    t_thr = w.trajectories / rate
    gen_lat = min(generation_latency(w, c.model, p) for p in pools)  # the fastest instance for one trajectory
    reset, step, reward = _lat(w.env_reset), _lat(w.env_step), _lat(w.reward)
    n, t = w.trajectories, w.turns
    env = reset.sample(rng, (samples, n)) + step.sample(rng, (samples, n, t)).sum(-1) + reward.sample(rng, (samples, n))
    lat_mean = gen_lat + float(env.mean())
    if level == "batch":  # a barrier after every stage: each stage waits for its slowest member
        per_turn = step.sample(rng, (samples, n, t)).max(1).sum(-1)
        lat_max = gen_lat + float((reset.sample(rng, (samples, n)).max(1) + per_turn + reward.sample(rng, (samples, n)).max(1)).mean())
    else:
        lat_max = gen_lat + float(env.max(1).mean())
    makespan = max(t_thr, lat_max)
    train = train_step_seconds(c.model, c.train_gpus, n * w.sample_tokens, c.train_gpu)
    update = c.update_s if c.update_s is not None else max(weight_load_seconds(c.model, p.gpu, p.tp) for p in pools)
    if alpha == 0:
        step_s, binding = makespan + update + train, "rollout+update+train"
    elif mode == "one_off":
        step_s = max(makespan, train) + update
        binding = ("rollout" if makespan >= train else "train") + "+update"
    else:
        cands = {"rollout_throughput+update": t_thr + update, "train": train, "latency/(alpha+1)": lat_mean / (alpha + 1)}
        binding = max(cands, key=cands.get)
        step_s = cands[binding]
    terms = {
        "rollout_throughput_s": t_thr,
        "latency_mean_s": lat_mean,
        "latency_max_s": lat_max,
        "makespan_s": makespan,
        "generation_latency_s": gen_lat,
        "train_s": train,
        "update_s": update,
        "tokens_per_step": n * w.sample_tokens,
        "trajectories_per_s": n / step_s,
        "alpha": alpha,
        "level": level,
    }
    return Ideal(mode, step_s, binding, terms)
