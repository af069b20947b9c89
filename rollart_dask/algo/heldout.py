"""A held-out evaluation's figures (pure: the run, `rollart eval`, the trackers, the report and the dashboard read them):
each with its 95% confidence interval (success: Wilson's interval for a proportion; reward: the normal interval of a
mean), and whether it is complete. An evaluation with a seed whose trajectory failed is incomplete: shown, logged and
plotted as such, never as a score."""

from __future__ import annotations

import math

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


def summarise(
    outcomes: dict[int, dict],
    n: int,
    seconds: float,
    failures: dict[str, int] | None = None,
    retried: int = 0,
    retried_for: dict[str, int] | None = None,
) -> dict:
    """A task's figures from its outcomes by seed: success and reward over the seeds that completed. A seed whose
    trajectory failed (after its retries) is no outcome at all: the evaluation is then incomplete (``complete``
    False), ``failures`` says why ({reason: seeds}), and its figures are not a score (see ``shown``)."""
    done = len(outcomes)
    success = sum(o["success"] for o in outcomes.values())
    reward, lo, hi = mean_interval([o["reward"] for o in outcomes.values()])
    return {
        "success": success / done if done else 0.0,
        "success_ci": [round(x, 4) for x in wilson(success, done)],
        "reward_mean": reward,
        "reward_ci": [round(lo, 4), round(hi, 4)],
        "complete": done == n,
        "completed": done,
        "failed_calls": n - done,
        "seeds": n,
        "failures": dict(failures or {}),
        "retried": retried,
        "retried_for": dict(retried_for or {}),
        "seconds": round(seconds, 2),
    }


def is_complete(fig: dict) -> bool:
    """Every seed played to its end (rows written before ``complete`` existed: no failed call)."""
    return bool(fig.get("complete", fig.get("failed_calls", 0) == 0))


def incomplete_note(fig: dict) -> str:
    """'incomplete: 37 of 100 eval calls failed (TimeoutError: …)': what is shown instead of an incomplete figure."""
    failures = sorted((fig.get("failures") or {}).items(), key=lambda kv: -kv[1])
    why = "; ".join(f"{r} ×{c}" if len(failures) > 1 else r for r, c in failures[:2]) + (
        f"; +{len(failures) - 2} more" if len(failures) > 2 else ""
    )
    return f"incomplete: {fig.get('failed_calls', '?')} of {fig.get('seeds', '?')} eval calls failed ({why or 'reason not recorded'})"


def shown(fig: dict, digits: int = 3) -> str:
    """A task's held-out success as text: the figure when complete, else the incomplete note (never a score)."""
    return f"{fig['success']:.{digits}f}" if is_complete(fig) else incomplete_note(fig)


def played_as(temperature: float | None) -> str:
    """How an evaluation chose its moves: 'greedy', or 'sampled at T=1' (pass@1 of one sample per seed)."""
    return "greedy" if not temperature else f"sampled at T={temperature:g}"


SCORES = ("success", "success_ci", "reward_mean", "reward_ci")


def loggable(fig: dict) -> dict:
    """A task's figures for trackers and series: an incomplete evaluation's scores left out (its failed count stays),
    and the failure reasons (free text) never as series names."""
    return {k: v for k, v in fig.items() if k not in ("failures", "retried_for") and (k not in SCORES or is_complete(fig))}


def reason(e: BaseException, width: int = 120) -> str:
    """Why a trajectory failed, grouped by: the exception's type and the first line of its message."""
    line = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return text if len(text) <= width else text[: width - 1] + "…"


def paired(a: dict[int, dict], b: dict[int, dict], key: str) -> dict:
    """A − B over the seeds both played, with the interval of the mean difference (each seed plays the same map)."""
    common = sorted(set(a) & set(b))
    diff, lo, hi = mean_interval([float(a[s][key]) - float(b[s][key]) for s in common])
    return {"diff": diff, "ci": [lo, hi], "seeds": len(common)}
