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
Here: the shared pieces (per-trajectory generation, latency, the pools). A run's ideal is emulation/flow_ideal.py;
the single-workload closed form of the modes above, which the tests check the emulation against, is
tests/oracles.py: ideal_step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rollart_dask.emulation.hardware import (
    GPUProfile,
    ModelProfile,
    decode_step_seconds,
    kv_capacity_tokens,
    prefill_flops,
    prefill_seconds,
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
