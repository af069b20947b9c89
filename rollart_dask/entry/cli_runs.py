"""`rollart` commands about finished runs: evaluate a checkpoint, fold a LoRA adapter into its base, list runs, report on them,
check that one replays another."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from rollart_dask.config import FlowError
from rollart_dask.observe import read_rows


def _interval(value: float, ci: list[float], digits: int = 2) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


@click.command("eval")
@click.argument("target", metavar="CHECKPOINT|RUN_DIR", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--task", "tasks", multiple=True, metavar="NAME", help="evaluate this task only (repeatable; default: every task of the flow)"
)
@click.option("--seeds", type=click.IntRange(min=1), default=None, help="seeds per task (default: the flow's held-out count)")
@click.option("--start", type=int, default=None, help="first seed (default: the held-out range, eval.start_seed)")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="0: greedy; above: sampled (default: the run's eval.temperature, 0 unless its flow set it)",
)
@click.option(
    "--compare",
    "other",
    type=click.Path(exists=True, file_okay=False),
    metavar="CHECKPOINT|RUN_DIR",
    help="a second checkpoint, evaluated on the same seeds: both side by side, and their paired difference",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a key of the run's flow, e.g. engine.backend=vllm")
@click.option("--out", default=None, type=click.Path(file_okay=False), help="where the evaluation writes (default runs/eval-<time>)")
def eval_command(target, tasks, seeds, start, temperature, other, overrides, out):
    """Evaluate CHECKPOINT (RUN/checkpoints/step-N) or RUN_DIR's latest checkpoint on held-out seeds, through the run's own
    engine, env and reward path: success and reward per task with their 95% confidence intervals (exit status 1 when an
    evaluation is incomplete: its calls failed)."""
    from rich.markup import escape
    from rich.table import Table

    from rollart_dask.algo.heldout import incomplete_note, is_complete
    from rollart_dask.entry.evaluate import compare, evaluate_sync
    from rollart_dask.observe import console

    out_dir = Path(out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    results = []
    try:
        for i, path in enumerate([target, *([other] if other else [])]):
            results.append(evaluate_sync(path, out_dir / ("a", "b")[i] if other else out_dir, tasks, seeds, start, temperature, overrides))
    except (FileNotFoundError, FlowError) as e:
        raise click.ClickException(str(e))
    names = [f"{Path(r['checkpoint']).name} (v{r['version']})" for r in results]
    first = results[0]
    how = "greedy" if not first["temperature"] else f"sampled at temperature {first['temperature']}"
    table = Table(title=f"{how}, seeds from {first['start_seed']}" + (" (the run's held-out range)" if first["held_out"] else ""))
    table.add_column("task")
    table.add_column("seeds", justify="right")
    for name in names:
        table.add_column(f"success {name} [95% CI]", justify="right")
        table.add_column(f"reward {name} [95% CI]", justify="right")
    diffs = compare(*results) if other else {}
    if other:
        table.add_column("success A − B [95% CI]", justify="right")
    for task, fig in first["eval"].items():
        row = [task, str(fig["seeds"])]
        for r in results:
            f = r["eval"].get(task)
            if f and not is_complete(f):  # its figures are not a score: why instead
                row += [f"[yellow]{escape(incomplete_note(f))}[/yellow]", "—"]
            else:
                row += [_interval(f["success"], f["success_ci"]), _interval(f["reward_mean"], f["reward_ci"], 3)] if f else ["—", "—"]
        if other:
            d = diffs[task]["success"]
            row.append(
                _interval(d["diff"], d["ci"]) + f" ({d['seeds']} seeds)" if diffs[task]["complete"] else "— (an evaluation is incomplete)"
            )
        table.add_row(*row)
    console.print(table)
    for r, name in zip(results, names):
        console.print(f"{name}: {r['checkpoint']}", markup=False)
        for t, f in r["eval"].items():
            if not is_complete(f):
                console.print(f"  {t}: {incomplete_note(f)}", markup=False, style="yellow")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps({"results": results, "compare": diffs}, indent=2))
    console.print(f"written: {(out_dir / 'eval.json').resolve()}")
    incomplete = [t for r in results for t, f in r["eval"].items() if not is_complete(f)]
    if incomplete:  # a script reading the exit status must not take it for a score
        raise click.ClickException(f"the evaluation of {', '.join(sorted(set(incomplete)))} is incomplete: no score (see above)")


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="the full Hugging Face model directory to write")
@click.option("--base", type=click.Path(exists=True, file_okay=False), help="the base model (default: the one the adapter's config names)")
def merge(checkpoint, out, base):
    """Fold the LoRA adapter of CHECKPOINT (a run with trainer.lora) into its base: a full model transformers and vLLM load."""
    from rollart_dask.data.lora import merge as merge_adapter

    try:
        path = merge_adapter(checkpoint, out, base)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e))
    click.echo(f"merged {checkpoint} into {path}")


@click.command("replay-diff")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
def replay_diff(run_a, run_b):
    """What RUN_B trained differently from RUN_A (two runs of one flow and seed with rollout.deterministic): per step the
    batch's digest and learning figures, each held-out figure, and the final checkpoint's sha256. Exit 1 on any difference."""
    from rollart_dask.tools.replay import compare

    out = compare(Path(run_a), Path(run_b))
    click.echo(
        f"compared {out['steps']} steps, {out['evals']} held-out evaluations; final checkpoints {out['checkpoints'][0]} / {out['checkpoints'][1]}"
    )
    for line in out["differences"][:20]:
        click.echo(f"  {line}")
    if out["differences"]:
        raise click.ClickException(f"{len(out['differences'])} differences: {run_b} does not replay {run_a}")
    click.echo("identical: every step trained the same batch to the same figures, and the final weights are bit-equal")


def run_row(run_dir: Path) -> dict:
    """What `rollart runs` shows of one run directory: its flow, mode, steps done (and planned: the flow's last start's,
    after a --resume the steps left) and last held-out evaluation."""
    import yaml

    from rollart_dask.algo.heldout import incomplete_note, is_complete

    flow = yaml.safe_load((run_dir / "flow.yaml").read_text()) if (run_dir / "flow.yaml").exists() else {}
    rows = read_rows(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval" and r.get("eval")]
    rollout = flow.get("rollout", {})
    mode = f"{rollout.get('mode', '?')} α={rollout.get('alpha', '?')}" if steps or not evals else "evaluation only (rollart eval)"
    return {
        "run": str(run_dir),
        "flow": flow.get("name", "?"),
        "mode": mode,
        "steps": len(steps),
        "planned": flow.get("trainer", {}).get("steps"),
        "version": steps[-1]["version"] if steps else 0,
        "held_out": {t: f["success"] if is_complete(f) else None for t, f in evals[-1]["eval"].items()}
        if evals
        else {},  # None: incomplete
        "held_out_incomplete": {t: incomplete_note(f) for t, f in evals[-1]["eval"].items() if not is_complete(f)} if evals else {},
        "held_out_at": evals[-1]["version"] if evals else None,
        "modified": (run_dir / "metrics.jsonl").stat().st_mtime,
    }


@click.command("runs")
@click.argument("root", default="runs", type=click.Path(file_okay=False))
def runs_command(root):
    """The runs under ROOT (any depth): flow, mode, steps, last held-out success, newest first."""
    from rich.markup import escape
    from rich.table import Table

    from rollart_dask.observe import console

    found = sorted((run_row(m.parent) for m in Path(root).rglob("metrics.jsonl")), key=lambda r: r["modified"], reverse=True)
    if not found:
        raise click.ClickException(f"no runs under {root} (a run directory holds metrics.jsonl)")
    table = Table(title=f"{len(found)} run(s) under {Path(root).resolve()}")
    for col in ("run", "flow", "mode", "steps (of planned)", "held-out success", "modified"):
        table.add_column(col, justify="right" if col.startswith("steps") else "left", overflow="fold")
    for r in found:
        held = ", ".join(
            f"{t} {s:.2f}" if s is not None else f"{t} {escape(r['held_out_incomplete'][t])}" for t, s in r["held_out"].items()
        ) + (f" @v{r['held_out_at']}" if r["held_out"] else "—")
        table.add_row(
            r["run"],
            r["flow"],
            r["mode"],
            f"{r['steps']} ({r['planned']})",
            held if r["held_out"] else "—",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r["modified"])),
        )
    console.print(table)


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR [RUN_DIR ...]", type=click.Path(file_okay=False))
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False),
    help="where index.html and its PNGs go (default: RUN_DIR/report for one run, report/ in the runs' common folder for several)",
)
def report_command(run_dirs, out):
    """A static HTML page with PNGs of one run, or comparing runs (a folder stands for every run below it): held-out
    success over time and versions, train reward, entropy/KL/clip fraction, staleness, aborted/dropped/failed, the six
    phases, pool busy fractions, weight transfer, the reward service."""
    from rollart_dask.extras import MissingExtra, require

    try:
        require("matplotlib", "report", "rollart report")
    except MissingExtra as e:
        raise click.ClickException(str(e))
    from rollart_dask.tools.report import ReportError, build_report

    try:
        index = build_report(list(run_dirs), out)
    except ReportError as e:
        raise click.ClickException(str(e))
    click.echo(f"report: {index.resolve()}")
