"""The normalised cost of an emulated run, in the paper's unit: one H20 GPU-hour = 1.00 (H800 2.85, Fig. 4's
table). CPUs and serverless rewards are priced in the same unit through public price lists, each price below
with its source; every one is a constant to change, none is measured here.

Per step: every GPU the variant holds (generation pools, trainer, a dedicated reward GPU when rewards are
local) and every env host, for the step's length; serverless rewards only for their billed seconds.
"""

from __future__ import annotations

from rollart_dask.emulation.hardware import GPUS

# The unit in dollars, to price what the paper's table does not. ASSUMED conversion: an H800 is priced as an H100
# (same Hopper die; AWS p5.48xlarge, 8 × H100, on-demand us-east-1 after AWS's June 2025 price cut: $55.04/h,
# i.e. $6.88 per GPU-hour), so 2.85 units = $6.88/h and one unit = $2.41/h.
USD_PER_UNIT_HOUR = 55.04 / 8 / 2.85
# An env host (a CPU-pool worker): one AWS c7i.xlarge (4 vCPU, 8 GiB), on-demand us-east-1, $0.1785/h (ASSUMED size).
CPU_HOST_USD_HOUR = 0.1785
# A serverless reward: billed seconds at the dedicated reward GPU's rate (an H20 per second), no premium — ASSUMED
# (GPU function platforms bill per second of execution; their premium over a reserved GPU is left out).
REWARD_GPU = "H20"
SERVERLESS_PREMIUM = 1.0


def hourly_units(cfg, engine_workers: dict[str, int]) -> dict[str, float]:
    """What the variant holds, in units per hour: generation pools, trainer, env hosts, a dedicated reward GPU."""
    e = cfg.emulation
    out = {f"gpu:{p}": e.pools[p].gpus * n * GPUS[e.pools[p].gpu].cost for p, n in engine_workers.items() if p in e.pools and n}
    out["gpu:TRAIN"] = e.trainer.gpus * GPUS[e.trainer.gpu].cost
    out["cpu"] = sum(1 for w in cfg.cluster.workers if "CPU" in w.pools) * CPU_HOST_USD_HOUR / USD_PER_UNIT_HOUR
    if cfg.reward.mode == "local":
        out["gpu:REWARD"] = sum(1 for w in cfg.cluster.workers if "REWARD" in w.pools) * GPUS[REWARD_GPU].cost
    return out


def step_cost(cfg, engine_workers: dict[str, int], step_s: float, trajectories: float, reward_s_per_trajectory: float) -> dict:
    """Normalised cost of one step of ``step_s`` emulated seconds producing ``trajectories``, and per trajectory."""
    held = hourly_units(cfg, engine_workers)
    parts = {k: v * step_s / 3600 for k, v in held.items()}
    if cfg.reward.mode == "serverless":
        parts["serverless"] = trajectories * reward_s_per_trajectory / 3600 * GPUS[REWARD_GPU].cost * SERVERLESS_PREMIUM
    total = sum(parts.values())
    return {"per_step": total, "per_trajectory": total / trajectories if trajectories else None, "parts": parts}
