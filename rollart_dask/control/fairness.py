"""Fair batches (``rollout.fairness: task``): what is trained keeps the launched task mix, whatever α and admission.

Asynchrony biases training toward fast work twice over: a batch taken in completion order is made of the groups
that finished first, and a slow group's members outlive the staleness bound, are aborted, and after enough
relaunches the group is dropped. With fairness on, the SampleBuffer (buffer.py) does three things instead:

- each batch is filled by a quota: slot by slot, to the task whose trained count lags its share of the admitted
  groups most (the highest-averages rule), so after every step each task's trained share is within one group of its
  admitted share; the batch waits for the quota's groups rather than taking whatever finished first;
- a stale member is relaunched at once (before any new group is admitted) and never charged to ``max_relaunch``:
  a group is dropped only for failures, so staleness alone never removes a task's work;
- the shift is measured: per task, launched and trained shares since the run began, and their largest gap.

Pure (no Dask, no asyncio): tested without a cluster.
"""

from __future__ import annotations

from collections import Counter

FAIRNESS = ("none", "task")


def quota(admitted: Counter, trained: Counter, n: int) -> Counter | None:
    """Groups per task the next batch of ``n`` must hold: each slot goes to the task with the largest deficit
    (its admitted share × groups trained after this slot − its trained groups so far), among tasks with an
    untrained admitted group left. None when fewer than ``n`` admitted groups are untrained."""
    total = sum(admitted.values())
    if total - sum(trained.values()) < n:
        return None
    q: Counter = Counter()
    done = sum(trained.values())
    for k in range(1, n + 1):
        open_tasks = [t for t in sorted(admitted) if admitted[t] - trained[t] - q[t] > 0]
        t = max(open_tasks, key=lambda t: admitted[t] / total * (done + k) - trained[t] - q[t])
        q[t] += 1
    return q


def shares(counts: Counter) -> dict[str, float]:
    total = sum(counts.values())
    return {t: counts[t] / total for t in sorted(counts)} if total else {}


def mix_shift(launched: Counter, trained: Counter) -> dict:
    """Launched and trained task shares (groups, since the run began) and the largest gap in percentage points."""
    ls, ts = shares(launched), shares(trained)
    gap = max((abs(ts.get(t, 0.0) - ls.get(t, 0.0)) for t in set(ls) | set(ts)), default=0.0)
    return {
        "launched": {t: round(v, 4) for t, v in ls.items()},
        "trained": {t: round(v, 4) for t, v in ts.items()},
        "shift_pp": round(100 * gap, 2),
    }


def length_shift(launched: dict[str, list[float]], trained: dict[str, list[float]], bins: int = 4) -> float:
    """Within each task, the share of trained trajectories in each quantile bin of the launched trajectories' lengths
    (``bins`` bins: quartiles by default), against 1 / bins: the largest gap, in percentage points. Needs every launched
    trajectory's length, aborted ones included — known where lengths are drawn at launch (the policy simulator)."""
    gap = 0.0
    for task, xs in launched.items():
        ys = trained.get(task) or []
        if len(xs) < bins or not ys:
            continue
        xs = sorted(xs)
        edges = [xs[len(xs) * k // bins] for k in range(1, bins)]
        counts = [0] * bins
        for y in ys:
            counts[sum(y >= e for e in edges)] += 1
        gap = max(gap, max(abs(c / len(ys) - 1 / bins) for c in counts))
    return round(100 * gap, 2)
