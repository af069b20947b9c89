"""What each panel of the page plots, from a RunState: plain column dicts (no Bokeh), tested alone."""

from __future__ import annotations

from collections import Counter

from rollart_dask.control.buffer import LAG_PARTS
from rollart_dask.control.snapshot import COUNTS

STAGES = ("env-wait", "env-reset", "barrier", "generate", "env-step", "reward")  # EnvManager.stage values, in trajectory order
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _lines(series: dict[str, tuple[list, list]]) -> dict:
    names = sorted(series)
    return {
        "name": names,
        "xs": [series[n][0] for n in names],
        "ys": [series[n][1] for n in names],
        "color": [COLORS[i % len(COLORS)] for i in range(len(names))],
    }


def _points(lines: dict) -> dict:
    """The same series as single points (a series of one point draws no line)."""
    pts = [(x, y, c) for xs, ys, c in zip(lines["xs"], lines["ys"], lines["color"]) for x, y in zip(xs, ys)]
    return {"x": [p[0] for p in pts], "y": [p[1] for p in pts], "color": [p[2] for p in pts]}


def panel_data(state) -> dict:
    """Columns for every panel, plus ``summary``: per-panel totals the page renders as text and data
    attributes (what a reader, or a browser test, checks first)."""
    latest = state.latest if state is not None else {}
    steps = [state.steps[k] for k in sorted(state.steps)] if state is not None else []
    syncs = [state.syncs[k] for k in sorted(state.syncs)] if state is not None else []
    evals = [state.evals[k] for k in sorted(state.evals)] if state is not None else []

    inflight = Counter(latest.get("inflight") or {})
    stages = list(STAGES) + sorted(set(inflight) - set(STAGES))

    busy: dict[str, tuple[list, list]] = {}
    for s in steps:
        for pool, frac in s["busy"].items():
            xs, ys = busy.setdefault(pool, ([], []))
            xs.append(s["t"])
            ys.append(frac)

    gap: dict[str, tuple[list, list]] = {}  # per task: trained − launched share (pp), over run time
    for s in steps:
        for task, pp in (s.get("mix") or {}).items():
            xs, ys = gap.setdefault(task, ([], []))
            xs.append(s["t"])
            ys.append(pp)

    stale: Counter = Counter()
    for s in steps:
        stale.update({int(k): v for k, v in s["staleness"].items()})
    stale_x = list(range(max(stale, default=-1) + 1))
    lag = {part: Counter() for part in LAG_PARTS}  # the staleness's two parts: in flight, in the queue
    for s in steps:
        for part, hist in zip(LAG_PARTS, s.get("lag") or []):
            lag[part].update(dict(enumerate(hist)))  # (counts by versions 0, 1, …)
    lag_x = list(range(max((max(c, default=-1) for c in lag.values()), default=-1) + 1))

    # Policy version over time: it changes when Resume lets the engines run the new weights.
    version = {"t": [min(0.0, syncs[0]["t"]) if syncs else 0.0], "version": [syncs[0]["from"] if syncs else latest.get("version", 0)]}
    suspend = {"x0": [], "x1": [], "y": []}
    update = {"x0": [], "x1": [], "y": []}
    resume = {"t": [], "version": []}
    for s in syncs:
        t1 = s["t"] + s.get("suspend_s", 0.0)
        t2 = t1 + s.get("update_s", 0.0)
        suspend["x0"].append(s["t"]), suspend["x1"].append(t1), suspend["y"].append(s["version"])
        update["x0"].append(t1), update["x1"].append(t2), update["y"].append(s["version"])
        resume["t"].append(t2), resume["version"].append(s["version"])
        version["t"].append(t2), version["version"].append(s["version"])
    if latest:
        version["t"].append(latest.get("t", version["t"][-1]))
        version["version"].append(version["version"][-1])

    scores: dict[str, tuple[list, list]] = {}
    for e in evals:  # an incomplete evaluation is no point (the snapshot gives its failed calls instead of a success)
        for task, x in e["success"].items():
            if task in (e.get("failed") or {}):
                continue
            xs, ys = scores.setdefault(task, ([], []))
            xs.append(e["version"])
            ys.append(x)

    counts = latest.get("counts") or dict.fromkeys(COUNTS, 0)
    what = [k for k in counts if k != "finished"]
    summary = {
        "run": latest.get("name", ""),
        "status": latest.get("status", "waiting for a run"),
        "mode": latest.get("mode", ""),
        "alpha": latest.get("alpha", ""),
        "t": latest.get("t", 0.0),
        "step": max(state.steps, default=0) if state is not None else 0,
        "steps_target": latest.get("steps_target", 0),
        "version": latest.get("version", 0),
        "inflight": sum(inflight.values()),
        "busy_points": sum(len(xs) for xs, _ in busy.values()),
        "staleness": sum(stale.values()),
        "lag": sum(lag["in_flight"].values()),
        "syncs": len(syncs),
        "evals": len(evals),
        "counts": sum(counts.get(k, 0) for k in what),
        "finished": counts.get("finished", 0),
        "mix_shift_pp": max((abs(ys[-1]) for _, ys in gap.values()), default=0.0),
    }
    busy_lines, score_lines, gap_lines = _lines(busy), _lines(scores), _lines(gap)
    return {
        "inflight": {"stage": stages, "n": [inflight.get(s, 0) for s in stages]},
        "busy": busy_lines,
        "busy_points": _points(busy_lines),
        "staleness": {"x": stale_x, "n": [stale.get(x, 0) for x in stale_x]},
        "lag": {"x": lag_x, **{part: [lag[part].get(x, 0) for x in lag_x] for part in LAG_PARTS}},
        "version": version,
        "suspend": suspend,
        "update": update,
        "resume": resume,
        "counts": {"what": what, "n": [counts[k] for k in what]},
        "scores": score_lines,
        "scores_points": _points(score_lines),
        "mix": gap_lines,
        "mix_points": _points(gap_lines),
        "summary": summary,
    }
