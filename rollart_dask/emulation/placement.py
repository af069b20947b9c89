"""The placement predictor of emulated flows (control/placement.py names it): every mapping of the auto tasks (and,
with ``rollout.pd: auto``, prefill/decode disaggregated either way), simulated on the measured profile and the pools'
hardware, ranked by predicted step time.

The prediction is the discrete-event simulation of the runtime's own policy (simulate.py): the one whose
step times the ablations set beside the measured ones. Up to ``EXHAUSTIVE`` mappings are all simulated; with
more auto tasks the search goes task by task (each tries every affinity with the others fixed, until no
change helps), which simulates a few per task instead of 3^tasks.
"""

from __future__ import annotations

import itertools
import statistics

from rollart_dask.config import FlowConfig, PDConfig
from rollart_dask.resource.pools import ENGINE_POOLS
from rollart_dask.emulation.flow_ideal import reward_slots
from rollart_dask.emulation.simulate import simulate

AFFINITIES = ("prefill", "decode", "any")
EXHAUSTIVE = 27
WARMUP = 2


def predict(base: FlowConfig, mapping: dict[str, str], engine_workers: dict[str, int], seeds: int, pd: dict | None = None) -> dict:
    cfg = base.model_copy(deep=True)
    for t in cfg.tasks:
        if t.name in mapping:
            t.affinity = mapping[t.name]
    cfg.rollout.pd = PDConfig(**pd) if pd else None
    runs = [simulate(cfg, engine_workers, reward_slots(cfg), warmup=WARMUP, seed=s).step_s for s in range(seeds)]
    return {"mapping": dict(mapping), "pd": pd, "step_s": statistics.mean(runs), "step_sd_s": statistics.pstdev(runs)}


def pd_choices(engine_workers: dict[str, int]) -> list[dict]:
    """rollout.pd auto: both directions between the engine pools, where both have engines."""
    pools = [p for p in ENGINE_POOLS if engine_workers.get(p)]
    return [{"prefill": a, "decode": b} for a in pools for b in pools if a != b]


def rank_mappings(flow: dict, auto: list[str], engine_workers: dict[str, int], seeds: int = 2, pd_auto: bool = False) -> list[dict]:
    """``flow``: the profiled flow (control/placement.profiled_flow); every mapping tried, fastest first. ``pd_auto``: also
    prefill/decode disaggregated each way (the tasks' affinity then routes nothing: one row each, their mapping any)."""
    base = FlowConfig.model_validate(flow)
    rows = [predict(base, {t: "any" for t in auto}, engine_workers, seeds, pd) for pd in pd_choices(engine_workers)] if pd_auto else []
    if len(AFFINITIES) ** len(auto) <= EXHAUSTIVE:
        rows += [predict(base, dict(zip(auto, m)), engine_workers, seeds) for m in itertools.product(AFFINITIES, repeat=len(auto))]
        return sorted(rows, key=lambda r: r["step_s"])
    seen: dict[tuple, dict] = {}

    def tried(mapping: dict) -> dict:
        key = tuple(mapping[t] for t in auto)
        if key not in seen:
            seen[key] = predict(base, mapping, engine_workers, seeds)
        return seen[key]

    best = tried({t: "any" for t in auto})
    improved = True
    while improved:
        improved = False
        for task in auto:
            for a in AFFINITIES:
                row = tried({**best["mapping"], task: a})
                if row["step_s"] < best["step_s"]:
                    best, improved = row, True
    return sorted([*rows, *seen.values()], key=lambda r: r["step_s"])
