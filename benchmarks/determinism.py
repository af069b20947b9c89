"""What rollout.deterministic costs, and that it replays: the same flow side by side in one command.

Arms, each on a fresh embedded cluster, one after another: ``plain`` (the flow as written), ``schedule`` (the
deterministic schedule alone: level batch, no seeds, batched forwards) and ``deterministic`` twice. Prints per arm
the seconds per step (from the second step on; held-out evaluation off unless --set turns it on), what it trained
(trajectories, samples, tokens per step) and its last figures; then deterministic ÷ plain and schedule ÷ plain, and
whether the second deterministic run replayed the first (`rollart replay-diff`: every step's batch digest and
figures, and the final checkpoint's sha256).

    python benchmarks/determinism.py                          # the quickstart, 40 steps each, ~6 min on 2 cores
    python benchmarks/determinism.py --steps 10 --set model.kind=smollm2 --set rollout.batch_groups=2
"""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from rollart_dask.config import load_flow
from rollart_dask.entry.api import run_sync
from rollart_dask.observe import console, read_rows
from rollart_dask.tools.replay import compare

ARMS = {
    "plain": [],
    "schedule": ["rollout.level=batch"],  # batch by batch, as deterministic runs, with nothing else of it
    "deterministic": ["rollout.deterministic=true"],
    "deterministic-again": ["rollout.deterministic=true"],
}


def per_step(run_dir: Path) -> dict:
    steps = [r for r in read_rows(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    n = len(steps)
    return {
        "steps": n,
        "s_per_step": (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / (n - 1),
        **{k: sum(r[k] for r in steps) / n for k in ("trajectories", "samples", "tokens")},
        "success_last5": sum(r["success"] for r in steps[-5:]) / min(5, n),
    }


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--steps", default=40, show_default=True, help="training steps per run")
@click.option("--out", default="runs/bench-determinism", show_default=True)
@click.option("--set", "overrides", multiple=True, help="flow overrides for every arm (key=value)")
def main(flow, steps, out, overrides):
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    rows = {}
    for arm, extra in ARMS.items():
        cfg = load_flow(flow, [f"trainer.steps={steps}", "trainer.max_minutes=null", "eval.every=0", *overrides, *extra])
        console.print(f"[bold]{arm}[/bold]: level {cfg.rollout.level}, engine.max_batch {cfg.engine.max_batch}")
        run_sync(cfg, out / arm)
        rows[arm] = per_step(out / arm)
    console.print(f"{'arm':20s} {'s/step':>7s} {'traj/step':>9s} {'samples/step':>12s} {'tokens/step':>11s} {'success (last 5)':>16s}")
    for arm, r in rows.items():
        console.print(
            f"{arm:20s} {r['s_per_step']:7.3f} {r['trajectories']:9.1f} {r['samples']:12.1f} {r['tokens']:11.1f} {r['success_last5']:16.3f}"
        )
    base = rows["plain"]["s_per_step"]
    console.print(
        f"s/step ÷ plain: schedule {rows['schedule']['s_per_step'] / base:.2f}, deterministic {rows['deterministic']['s_per_step'] / base:.2f}"
    )
    same = compare(out / "deterministic", out / "deterministic-again")
    verdict = "identical" if not same["differences"] else f"{len(same['differences'])} differences: {same['differences'][:3]}"
    console.print(f"replay: {same['steps']} steps compared, final checkpoint {same['checkpoints'][0]}: {verdict}")


if __name__ == "__main__":
    main()
