"""Closed forms the tests check the emulation against (test-only: the runtime and the tools use flow_ideal and the
simulator). Each is the plain formula of one case — a single-task workload's ideal step, a disaggregated request
alone, a continuous batch drained with no new arrivals — so a test can compare the emulated timeline with it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollart_dask.emulation.hardware import (
    H800,
    KV_LINK_GBPS,
    GPUProfile,
    ModelProfile,
    decode_step_seconds,
    kv_transfer_seconds,
    prefill_seconds,
    train_step_seconds,
    weight_load_seconds,
)
from rollart_dask.emulation.ideal import Ideal, Latency, Pool, Workload, generation_latency, per_trajectory_seconds


@dataclass(frozen=True)
class Cluster:
    model: ModelProfile
    generation: tuple[Pool, ...]
    train_gpus: int
    train_gpu: GPUProfile = H800
    update_s: float | None = None  # default: weight load of the slowest generation instance


def _lat(x) -> Latency:
    return x if isinstance(x, Latency) else Latency(float(x))


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


def pd_request_seconds(
    model: ModelProfile,
    prefill_gpu: GPUProfile,
    decode_gpu: GPUProfile,
    prompt_tokens: int,
    output_tokens: int,
    link_gbps: float = KV_LINK_GBPS,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> dict:
    """One request alone under prefill/decode disaggregation: the prompt's prefill (and its first token)
    on the prefill GPU, the KV transfer, then one decode step per further token on the decode GPU, the
    context growing by one token a step (batch 1)."""
    prefill = prefill_seconds(model, prefill_gpu, prompt_tokens, prefill_tp)
    transfer = kv_transfer_seconds(model, prompt_tokens, link_gbps) if output_tokens > 1 else 0.0
    decode = sum(decode_step_seconds(model, decode_gpu, 1, prompt_tokens + 1 + k, decode_tp) for k in range(output_tokens - 1))
    return {"prefill_s": prefill, "transfer_s": transfer, "decode_s": decode, "total_s": prefill + transfer + decode}


def drain(batch) -> None:
    """Run a ContinuousBatch until everything submitted is done (no new arrivals): the pure timeline."""
    while batch.waiting or batch.running:
        batch.admit()
        if batch.running:
            batch.decode(max(1, batch.steps_to_next_finish()))
