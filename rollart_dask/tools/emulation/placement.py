"""The placement predictor of emulated flows (control/placement.py names it): every mapping of the auto tasks,
simulated on the measured profile and the pools' hardware, ranked by predicted step time.

The prediction is the discrete-event simulation of the runtime's own policy (simulate.py): the one whose
step times the ablations set beside the measured ones. Up to ``EXHAUSTIVE`` mappings are all simulated; with
more auto tasks the search goes task by task (each tries every affinity with the others fixed, until no
change helps), which simulates a few per task instead of 3^tasks.
"""
from __future__ import annotations

import itertools
import statistics

from rollart_dask.config import FlowConfig
from rollart_dask.tools.emulation.flow_ideal import reward_slots
from rollart_dask.tools.emulation.simulate import simulate

AFFINITIES = ("prefill", "decode", "any")
EXHAUSTIVE = 27
WARMUP = 2


def predict(base: FlowConfig, mapping: dict[str, str], engine_workers: dict[str, int], seeds: int) -> dict:
    cfg = base.model_copy(deep=True)
    for t in cfg.tasks:
        if t.name in mapping:
            t.affinity = mapping[t.name]
    runs = [simulate(cfg, engine_workers, reward_slots(cfg), warmup=WARMUP, seed=s).step_s for s in range(seeds)]
    return {"mapping": dict(mapping), "step_s": statistics.mean(runs), "step_sd_s": statistics.pstdev(runs)}


def rank_mappings(flow: dict, auto: list[str], engine_workers: dict[str, int], seeds: int = 2) -> list[dict]:
    """``flow``: the profiled flow (control/placement.profiled_flow); every mapping tried, fastest first."""
    base = FlowConfig.model_validate(flow)
    if len(AFFINITIES) ** len(auto) <= EXHAUSTIVE:
        rows = [predict(base, dict(zip(auto, m)), engine_workers, seeds) for m in itertools.product(AFFINITIES, repeat=len(auto))]
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
    return sorted(seen.values(), key=lambda r: r["step_s"])
