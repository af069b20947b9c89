"""Time to target held-out success: mode=sync (veRL-style baseline) vs mode=rollart (α=1), side by side.

Both runs use the same flow (default flows/quickstart.yaml), seeds and budget, one after the
other in this process, each on a fresh embedded cluster. Prints one table:
time and steps to reach the target, and the best held-out success of each run.

    python benchmarks/sync_vs_rollart.py                       # full: 12 min budget per mode
    python benchmarks/sync_vs_rollart.py --minutes 1 --target 0.05 --set eval.seeds=20   # a quick look
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from rollart_dask.entry.api import run_sync
from rollart_dask.algo.heldout import is_complete
from rollart_dask.config import load_flow
from rollart_dask.observe import console

MODES = {
    "sync": ["rollout.mode=sync", "rollout.alpha=0", "rollout.level=batch"],
    "rollart α=1": ["rollout.mode=rollart", "rollout.alpha=1", "rollout.level=trajectory"],
}


def time_to_target(rows: list[dict], task: str, target: float):
    for r in rows:
        if r["kind"] == "eval" and is_complete(r["eval"][task]) and r["eval"][task]["success"] >= target:  # (an incomplete one is no score)
            return r["elapsed_s"], r["version"]
    return None, None


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--minutes", default=12.0, show_default=True, help="training budget per mode")
@click.option("--target", default=0.8, show_default=True, help="held-out success to reach")
@click.option("--out", default="runs/bench-sync-vs-rollart", show_default=True)
@click.option("--set", "overrides", multiple=True)
def main(flow, minutes, target, out, overrides):
    results = {}
    for name, mode_over in MODES.items():
        cfg = load_flow(flow, [*mode_over, f"trainer.max_minutes={minutes}", "trainer.steps=100000", "observe.progress=false", *overrides])
        out_dir = Path(out) / name.split()[0]
        console.print(f"[bold]{name}[/bold]: {cfg.rollout.mode} level={cfg.rollout.level} α={cfg.rollout.alpha}")
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # a run appends to its directory's log: read this run's rows only
        res = run_sync(cfg, out_dir)
        (out_dir / "summary.json").write_text(
            json.dumps(res, indent=2, default=str)
        )  # as `rollart run` leaves it: `rollart report` reads it
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").open()]
        task = cfg.tasks[0].name
        t, v = time_to_target(rows, task, target)
        steps = [r for r in rows if r["kind"] == "step"]
        results[name] = {
            "time_to_target_s": t,
            "version_at_target": v,
            "best": max((r["eval"][task]["success"] for r in rows if r["kind"] == "eval" and is_complete(r["eval"][task])), default=None),
            "steps": res["steps"],
            "s_per_step": (steps[-1]["elapsed_s"] / len(steps)) if steps else None,
        }
    from rich.table import Table

    table = Table(title=f"time to held-out success ≥ {target} ({flow}, {minutes} min budget each)")
    for col in ("mode", "time to target", "steps to target", "best held-out", "steps run", "s/step"):
        table.add_column(col)
    for name, r in results.items():
        t = f"{r['time_to_target_s']:.0f} s" if r["time_to_target_s"] is not None else "not reached"
        table.add_row(
            name,
            t,
            str(r["version_at_target"] or "-"),
            f"{r['best']:.3f}",
            str(r["steps"]),
            f"{r['s_per_step']:.2f}" if r["s_per_step"] else "-",
        )
    console.print(table)
    a, b = results["sync"]["time_to_target_s"], results["rollart α=1"]["time_to_target_s"]
    if a and b:
        console.print(f"rollart α=1 reaches the target {a / b:.2f}x faster than sync")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
