"""`rollart report`: one static HTML page (index.html beside its PNGs) of one run, or comparing runs, read from their
run directories alone (metrics.jsonl, flow.yaml, summary.json) — no cluster, no live run needed; a run still writing
is reported as far as it got."""

from __future__ import annotations

import html
import time
from pathlib import Path

import yaml

from rollart_dask.algo.heldout import incomplete_note, is_complete
from rollart_dask.tools.report.figures import FIGURES
from rollart_dask.tools.report.runs import ReportError, RunData, common_folder, load_runs

__all__ = ["ReportError", "build_report", "default_out"]

STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:13px}.incomplete{color:#b00}
pre{background:#f8f8f8;padding:8px;font-size:12px;overflow:auto}.muted{color:#777}"""

CAPTIONS = {  # what each figure reads from (the metrics.jsonl keys), so a reader can check it against the rows
    "heldout.png": "eval rows: success per task on the held-out seeds (greedy unless eval.temperature), with the 95% interval; against wall time and policy version. "
    "An incomplete evaluation (eval calls that failed after their retries) is no score: left out, a dotted vertical line, labelled.",
    "train.png": "step rows: reward_mean and success of the trained batch.",
    "policy.png": "step rows: entropy, approx_kl (to the behaviour policy), clip_frac of the update.",
    "staleness.png": "step rows: staleness histogram of the trained trajectories (versions behind the trainer).",
    "lag.png": "step rows: lag_hist — each trained trajectory's staleness split into the versions installed while it ran (in flight) "
    "and those published between its finish and its Train (in the queue), summed over the run; p50/p90/max per step are lag_in_*_p*.",
    "dropped.png": "step rows: the buffer's cumulative counts of aborted, dropped (staleness), failed and filtered work; reissued calls.",
    "phases.png": "step rows: get_batch, suspend, update, recompute_kv, train and wait_train seconds of each step.",
    "pools.png": "step rows: pool_busy — the fraction of each pool's slots busy during the step.",
    "weights.png": "step rows: weights publish, engines' pull and the rollout's wait for a version.",
    "rewards.png": "step rows: reward service calls, per-reward latency and utilisation.",
}


def default_out(runs: list[RunData]) -> Path:
    """One run: RUN_DIR/report; several: report/ in their common folder."""
    return runs[0].path / "report" if len(runs) == 1 else common_folder([r.path for r in runs]) / "report"


def _heldout(run: RunData) -> str:
    if not run.evals:
        return "—"
    last = run.evals[-1]
    out = []
    for task, f in sorted(last["eval"].items()):
        if not is_complete(f):  # not a score: marked, with why
            out.append(f"<b class=incomplete>{html.escape(task)} {html.escape(incomplete_note(f))}</b>")
            continue
        ci = f.get("success_ci")
        out.append(html.escape(f"{task} {f['success']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")))
    return "<br>".join(out) + f" <span class=muted>@v{last.get('version', '?')}</span>"


def _elapsed(run: RunData) -> str:
    """The run's wall time as its summary says (set-up included), else the minutes its rows span."""
    if run.summary.get("wall_s"):
        return f"{run.summary['wall_s'] / 60:.1f} min"
    rows = run.steps or run.evals
    return f"{run.minutes(rows[-1]):.1f} min <span class=muted>(so far)</span>"


def _accounting(run: RunData) -> str:
    a = run.summary.get("accounting") or {}
    if not a:
        return "— <span class=muted>(no summary.json: the run has not finished)</span>" if not run.summary else "—"
    ends = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in a.items() if isinstance(v, int) and v and k != "launched")
    return html.escape(f"{a.get('launched', '?')} launched: {ends}")


def _table(runs: list[RunData]) -> str:
    head = ("run", "flow", "mode", "steps", "version", "elapsed", "last held-out success [95% CI]", "trajectories")
    rows = []
    for run in runs:
        planned = (run.flow.get("trainer") or {}).get("steps")
        cells = [
            f"<b>{html.escape(run.label)}</b><br><span class=muted>{html.escape(str(run.path.resolve()))}</span>",
            html.escape(str(run.flow.get("name", "?"))),
            html.escape(run.mode),
            f"{len(run.steps)}"
            + (f" of {planned}" if planned and planned >= len(run.steps) else ""),  # a --resume's flow plans the rest only
            str(run.steps[-1]["version"]) if run.steps else "0",
            _elapsed(run),
            _heldout(run),
            _accounting(run),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def build_report(paths: list[str | Path], out: str | Path | None = None, dpi: int = 100) -> Path:
    """Write OUT/index.html and one PNG per figure that any of the runs has; return index.html's path.
    Raises ReportError naming the directory that is not a run."""
    runs = load_runs(paths)
    out_dir = Path(out) if out else default_out(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections, skipped = [], []
    for name, heading, make in FIGURES:
        fig = make(runs)
        if fig is None:
            skipped.append(heading)
            continue
        fig.savefig(out_dir / name, dpi=dpi)
        sections.append(
            f"<section><h2>{html.escape(heading)}</h2><figure><img src='{name}' alt='{html.escape(heading)}'>"
            f"<figcaption>{html.escape(CAPTIONS[name])}</figcaption></figure></section>"
        )
    flows = "".join(
        f"<details><summary>flow of {html.escape(r.label)}</summary><pre>{html.escape(yaml.safe_dump(r.flow, sort_keys=False))}</pre></details>"
        for r in runs
        if r.flow
    )
    title = f"rollart report — {runs[0].label}" if len(runs) == 1 else f"rollart report — {len(runs)} runs compared"
    note = f"<p class=muted>not drawn (no run recorded their figures): {html.escape(', '.join(skipped))}</p>" if skipped else ""
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p class=muted>written {time.strftime('%Y-%m-%d %H:%M')} from the runs' metrics.jsonl, "
        f"flow.yaml and summary.json</p>{_table(runs)}{flows}{''.join(sections)}{note}</body></html>"
    )
    index = out_dir / "index.html"
    index.write_text(page)
    return index
