"""The report's figures, each from the runs' metrics.jsonl rows (runs.py); each returns a matplotlib Figure, or None
when no run has its figures (an older run, an EMULATED run without a policy).

Figures that put one line per run compare runs on one axes; those with several series per run (phases, pools,
staleness, drops) give each run a panel of its own, on shared axes. No pyplot: Figure objects only (no global
state, no display needed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from matplotlib.figure import Figure

from rollart_dask.algo.heldout import is_complete
from rollart_dask.tools.report.runs import RunData

PHASES = ("get_batch_s", "suspend_s", "update_s", "recompute_kv_s", "train_s", "wait_train_s")  # a step's six phases (control/run.py)
NOT_DROPPED = ("finished", "groups_trained")  # the buffer counts that are not a loss
COLORS = [f"C{i}" for i in range(10)]


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _get(row: dict, path: str):
    """``row["a"]["b"]`` for "a/b"; None where missing."""
    node = row
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _series(rows: list[dict], path: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], v) for r in rows if (v := _get(r, path)) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(ys: list[float], k: int = 5) -> list[float]:
    """Trailing mean over k steps: a per-step train figure of a few groups is noisy."""
    return [sum(ys[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(ys))]


def _grid(n: int, cols: int, title: str, height: float = 3.0, sharey: bool = False) -> tuple[Figure, list]:
    rows = (n + cols - 1) // cols
    fig = Figure(figsize=(5.2 * cols, height * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharex=False, sharey=sharey).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes[:n]


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def heldout(runs: list[RunData]) -> Figure | None:
    """Held-out success per task, with its 95% interval, against minutes and against policy versions."""
    if not any(r.evals for r in runs):
        return None
    fig, (by_time, by_version) = _grid(2, 2, "held-out success (95% interval)")
    for i, run in enumerate(runs):
        tasks = sorted({t for e in run.evals for t in e["eval"]})
        for j, task in enumerate(tasks):
            # an incomplete evaluation is no score: left out of the line, marked by a dotted vertical line instead
            rows = [e for e in run.evals if task in e["eval"] and is_complete(e["eval"][task])]
            missing = [e for e in run.evals if task in e["eval"] and not is_complete(e["eval"][task])]
            ys = [e["eval"][task]["success"] for e in rows]
            lo = [e["eval"][task].get("success_ci", [y, y])[0] for e, y in zip(rows, ys)]
            hi = [e["eval"][task].get("success_ci", [y, y])[1] for e, y in zip(rows, ys)]
            label = run.label if len(tasks) == 1 else f"{run.label} · {task}"
            style = ("-", "--", ":", "-.")[j % 4]
            for ax, x in ((by_time, run.minutes), (by_version, lambda e: e["version"])):
                if rows:
                    xs = [x(e) for e in rows]
                    ax.plot(xs, ys, style, marker=".", color=_color(i), label=label)
                    ax.fill_between(xs, lo, hi, color=_color(i), alpha=0.12, linewidth=0)
                for k, e in enumerate(missing):
                    ax.axvline(
                        x(e), color=_color(i), linestyle=":", linewidth=1, label=f"{label}: incomplete evaluation" if k == 0 else None
                    )
    by_time.set_xlabel("minutes since start")
    by_version.set_xlabel("policy version")
    for ax in (by_time, by_version):
        ax.set_ylabel("success")
        ax.set_ylim(-0.02, 1.02)
        _legend(ax)
    return fig


def _per_step_lines(runs: list[RunData], panels: list[tuple[str, str]], title: str, smooth: bool = False) -> Figure | None:
    """One panel per (metric path, y label), one line per run against its steps."""
    panels = [(p, y) for p, y in panels if any(_series(r.steps, p)[0] for r in runs)]
    if not panels:
        return None
    fig, axes = _grid(len(panels), min(3, len(panels)), title)
    for ax, (path, ylabel) in zip(axes, panels):
        for i, run in enumerate(runs):
            xs, ys = _series(run.steps, path)
            if not xs:
                continue
            if smooth:
                ax.plot(xs, ys, color=_color(i), alpha=0.25, linewidth=0.8)
                ys = _smooth(ys, max(5, _window(len(ys))))
            ax.plot(xs, ys, color=_color(i), label=run.label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        _legend(ax)
    return fig


def train(runs: list[RunData]) -> Figure | None:
    tasks = sorted({t for r in runs for s in r.steps for t in s.get("tasks", {})})
    per_task = [(f"tasks/{t}/success", f"train success · {t}") for t in tasks] if len(tasks) > 1 else []
    return _per_step_lines(
        runs,
        [("reward_mean", "train reward"), ("success", "train success"), *per_task],
        "training batches (faint: per step; line: trailing mean)",
        smooth=True,
    )


def policy(runs: list[RunData]) -> Figure | None:
    return _per_step_lines(
        runs,
        [("entropy", "entropy"), ("approx_kl", "approx. KL to the behaviour policy"), ("clip_frac", "PPO clip fraction")],
        "the policy's update (faint: per step; line: trailing mean)",
        smooth=True,
    )


def weights(runs: list[RunData]) -> Figure | None:
    stores = sorted(
        {
            f"{s['weights'].get('store', '?')} ({s['weights'].get('bytes', 0) / 2**20:.2f} MiB per version)"
            for r in runs
            for s in r.steps
            if isinstance(s.get("weights"), dict)
        }
    )
    return _per_step_lines(
        runs,
        [
            ("weights/publish_s", "publish (s)"),
            ("weights/transfer_s", "engines' pull (s)"),
            ("weights/waited_s", "rollout waited for weights (s)"),
        ],
        "weight transfer: " + ", ".join(stores),
    )


def rewards(runs: list[RunData]) -> Figure | None:
    names = sorted({n for r in runs for s in r.steps for n in (s.get("reward") or {}).get("rewards", {})})
    return _per_step_lines(
        runs,
        [
            ("reward/calls", "reward calls per step"),
            *[(f"reward/rewards/{n}/latency_ms", f"{n}: latency (ms)") for n in names],
            ("reward/utilisation", "reward service utilisation"),
            ("reward/cold_starts", "serverless cold starts"),
            ("reward/throttles", "serverless throttles"),
            ("reward/errors", "serverless errors"),
        ],
        "reward service (" + ", ".join(sorted({str((s.get("reward") or {}).get("mode")) for r in runs for s in r.steps})) + ")",
    )


def _per_run(
    runs: list[RunData], title: str, ylabel: str, draw: Callable, omit_if_empty: bool = True, xlabel: str = "step"
) -> Figure | None:
    """One panel per run (``draw(ax, run)`` returns False when the run has nothing to draw), shared y axis. With
    ``omit_if_empty`` False, a figure no run has anything for is still drawn ("none recorded" is the news: nothing lost)."""
    drawn = [r for r in runs if r.steps]
    if not drawn:
        return None
    fig, axes = _grid(len(drawn), min(2, len(drawn)), title, sharey=True)
    any_drawn = False
    for ax, run in zip(axes, drawn):
        ok = draw(ax, run)
        any_drawn |= bool(ok)
        if not ok:
            ax.text(0.5, 0.5, "none recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(run.label, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        _legend(ax)
    return fig if any_drawn or not omit_if_empty else None


def _window(n: int) -> int:
    """Steps averaged per point in a panel's lines: a run of hundreds of steps draws a band of noise otherwise."""
    return max(1, n // 60)


def _stack(ax, xs: list, series: dict[str, list[float]]) -> bool:
    if not xs or not series:
        return False
    k = _window(len(xs))
    ax.stackplot(xs, *(_smooth(ys, k) for ys in series.values()), labels=list(series), alpha=0.85, step="mid")
    _say_window(ax, k)
    return True


def _say_window(ax, k: int) -> None:
    if k > 1:
        ax.set_title(f"mean of the last {k} steps", fontsize=7, loc="right")


def phases(runs: list[RunData]) -> Figure | None:
    def draw(ax, run):
        have = [p for p in PHASES if any(p in s for s in run.steps)]
        return _stack(ax, [s["step"] for s in run.steps], {p.removesuffix("_s"): [float(s.get(p) or 0.0) for s in run.steps] for p in have})

    return _per_run(runs, "a step's six phases (seconds, stacked)", "seconds", draw)


def staleness_shares(steps: list[dict]) -> dict[int, list[float]]:
    """Per staleness value (trainer version − the version a trajectory started at), its share of each step's trained
    trajectories; a step without a histogram counts as none."""
    hist = [{int(k): v for k, v in (s.get("staleness") or {}).items() if k.lstrip("-").isdigit()} for s in steps]
    total = [sum(h.values()) or 1 for h in hist]
    return {v: [h.get(v, 0) / t for h, t in zip(hist, total)] for v in sorted({k for h in hist for k in h})}


def staleness(runs: list[RunData]) -> Figure | None:
    def draw(ax, run):
        shares = staleness_shares(run.steps)
        return _stack(ax, [s["step"] for s in run.steps], {f"{v} behind": ys for v, ys in shares.items()})

    return _per_run(runs, "staleness of the trained trajectories (share per step)", "share", draw)


def lag_totals(steps: list[dict]) -> dict[str, dict[int, int]]:
    """The trained trajectories of the whole run by versions in flight and by versions in the queue (the step rows'
    ``lag_hist``: the two parts of each one's staleness); {} for rows without them."""
    totals: dict[str, Counter] = {}
    for s in steps:
        for part, hist in (s.get("lag_hist") or {}).items():
            totals.setdefault(part, Counter()).update({int(k): v for k, v in hist.items()})
    return {part: dict(sorted(c.items())) for part, c in totals.items()}


def lag(runs: list[RunData]) -> Figure | None:
    def draw(ax, run):
        totals = lag_totals(run.steps)
        for shift, (part, label) in zip((-0.2, 0.2), (("in_flight", "in flight"), ("in_queue", "in the queue"))):
            hist = totals.get(part, {})
            ax.bar([v + shift for v in hist], list(hist.values()), width=0.4, label=label)
        ax.set_xticks(sorted({v for hist in totals.values() for v in hist}))
        return bool(totals)

    title = "staleness split: versions in flight, in the queue"
    return _per_run(runs, title, "trajectories", draw, xlabel="versions")


def pools(runs: list[RunData]) -> Figure | None:
    def draw(ax, run):
        names = sorted({p for s in run.steps for p in s.get("pool_busy", {})})
        k = _window(len(run.steps))
        for p in names:
            xs, ys = _series(run.steps, f"pool_busy/{p}")
            ax.plot(xs, _smooth(ys, k), label=p)
        if names:
            _say_window(ax, k)
        return bool(names)

    return _per_run(runs, "pool busy fraction per step (CPU: env calls in flight)", "busy", draw)


def dropped(runs: list[RunData]) -> Figure | None:
    """The buffer's counts of work not trained (cumulative over the run) and the calls reissued after a lost worker."""

    def draw(ax, run):
        keys = sorted({k for s in run.steps for k in s.get("buffer", {}) if k not in NOT_DROPPED})
        for k in keys:
            xs, ys = _series(run.steps, f"buffer/{k}")
            ax.plot(xs, ys, label=k.replace("_", " "))
        if any(s.get("reissued") for s in run.steps):
            ax.plot(*_series(run.steps, "reissued"), label="reissued calls", linestyle="--")
        return bool(keys)

    return _per_run(runs, "aborted, dropped and failed (cumulative)", "count", draw, omit_if_empty=False)


FIGURES: list[tuple[str, str, Callable]] = [  # (file, heading, figure)
    ("heldout.png", "Held-out success", heldout),
    ("train.png", "Training reward and success", train),
    ("policy.png", "Entropy, KL, clip fraction", policy),
    ("staleness.png", "Staleness over time", staleness),
    ("lag.png", "Staleness in flight and in the queue", lag),
    ("dropped.png", "Aborted, dropped, failed", dropped),
    ("phases.png", "Step phases", phases),
    ("pools.png", "Pool busy fractions", pools),
    ("weights.png", "Weight transfer", weights),
    ("rewards.png", "Reward service", rewards),
]
