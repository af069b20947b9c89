"""Held-out evaluation: a task's seeds played through the run's own engines, envs and rewards, each
figure with its 95% confidence interval (success: Wilson's interval for a proportion; reward: the normal
interval of a mean). The run evaluates this way every ``eval.every`` steps; `rollart eval` does it for any
checkpoint on any seed range, and compares two checkpoints seed by seed (a paired difference)."""
from __future__ import annotations

import asyncio
import math
import time

from rollart_dask.types import Trajectory

Z95 = 1.959964


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a success rate (sound at 0 and 1, where the normal interval collapses)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float, float]:
    """The mean and its normal 95% interval (the sample standard deviation; a single value has none)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0, 0.0
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, mean - z * sd / math.sqrt(n), mean + z * sd / math.sqrt(n)


def summarise(outcomes: dict[int, dict], n: int, seconds: float) -> dict:
    """A task's figures from its outcomes by seed (a seed whose trajectory failed counts as no success; the reward is the
    mean over the trajectories that ended)."""
    success = sum(o["success"] for o in outcomes.values())
    reward, lo, hi = mean_interval([o["reward"] for o in outcomes.values()])
    return {"success": success / n if n else 0.0, "success_ci": [round(x, 4) for x in wilson(success, n)],
            "reward_mean": reward, "reward_ci": [round(lo, 4), round(hi, 4)], "failed_calls": n - len(outcomes), "seeds": n,
            "seconds": round(seconds, 2)}


def paired(a: dict[int, dict], b: dict[int, dict], key: str) -> dict:
    """A − B over the seeds both played, with the interval of the mean difference (each seed plays the same map)."""
    common = sorted(set(a) & set(b))
    diff, lo, hi = mean_interval([float(a[s][key]) - float(b[s][key]) for s in common])
    return {"diff": diff, "ci": [lo, hi], "seeds": len(common)}


async def play(em, task, seeds: range, tag: str, greedy: bool = True) -> tuple[dict, dict[int, dict]]:
    """Play ``task`` on ``seeds`` (all at once: a slow env does not serialise the others); its figures and outcomes by seed."""
    t0 = time.monotonic()
    trajs = [Trajectory(id=f"eval-{tag}-{task.name}-{s}", group_id="eval", task=task.name, seed=s) for s in seeds]
    results = await asyncio.gather(*(em.run(t, task, greedy=greedy) for t in trajs), return_exceptions=True)
    outcomes = {t.seed: {"success": float(t.success), "reward": float(t.reward)} for t in results if isinstance(t, Trajectory)}
    return summarise(outcomes, len(trajs), time.monotonic() - t0), outcomes
