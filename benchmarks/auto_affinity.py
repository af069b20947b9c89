"""`affinity: auto` against every hand-written mapping, on the EMULATED multi-task workload, in one command.

FrozenLake (prefill-heavy) and GEM-Math (decode-heavy) from flows/ablations/workloads/multitask.yaml on
2 EMULATED H800 + 2 EMULATED H20 GPUs (small pools, so that where each task generates matters). Every
mapping — each task on prefill (H800), decode (H20) or any (either) — runs on a fresh embedded cluster and
its step time is measured (after 2 warm-up steps); then one run with both tasks on `affinity: auto`
measures the tasks for `placement.profile_steps`, predicts every mapping on the measured profile and takes
the fastest. Prints every mapping ranked by measured step time beside its prediction, which one auto
chose, the step time auto reached after the switch against the best hand mapping's, and the error of the
prediction it printed.

    python benchmarks/auto_affinity.py              # ~12 min on 2 cores
    python benchmarks/auto_affinity.py --steps 12   # a quicker, noisier look
"""
from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import click
import yaml

from rollart_dask.config import load_flow
from rollart_dask.entry.api import run_sync
from rollart_dask.observe import console
from rollart_dask.tools.ablation.measure import summarise

WORKLOAD = Path("flows/ablations/workloads/multitask.yaml")
TASKS = ("frozenlake", "math")
SMALL_POOLS = ["emulation.pools.H800.gpus=2", "emulation.pools.H20.gpus=2"]
WARMUP = 2


def flow(affinity: dict[str, str], steps: int, extra: list[str]):
    data = yaml.safe_load(WORKLOAD.read_text())
    data["tasks"] = [t for t in data["tasks"] if t["name"] in TASKS]
    return load_flow(data=data, overrides=[*SMALL_POOLS, f"trainer.steps={steps}", *(f"tasks.{t}.affinity={a}" for t, a in affinity.items()),
                                           *extra])


def label(mapping: dict[str, str]) -> str:
    return ", ".join(f"{t} {a}" for t, a in mapping.items())


@click.command()
@click.option("--steps", default=18, show_default=True, help="training steps per run")
@click.option("--out", default="runs/bench-auto-affinity", show_default=True)
@click.option("--set", "overrides", multiple=True, help="flow overrides for every run (key=value)")
def main(steps, out, overrides):
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: fresh runs only
    measured = {}
    for combo in itertools.product(("prefill", "decode", "any"), repeat=len(TASKS)):
        mapping = dict(zip(TASKS, combo))
        cfg = flow(mapping, steps, list(overrides))
        console.print(f"[bold]{label(mapping)}[/bold]: {steps} steps [yellow](EMULATED hardware)[/yellow]")
        run_dir = out / "-".join(combo)
        run_sync(cfg, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        measured[label(mapping)] = summarise(rows, cfg.emulation.time_scale, WARMUP)["step_s"]
    cfg = flow({t: "auto" for t in TASKS}, steps, list(overrides))
    console.print(f"[bold]affinity auto[/bold]: {steps} steps [yellow](EMULATED hardware)[/yellow]")
    auto = run_sync(cfg, out / "auto")["placement"]
    if not auto.get("mapping") or auto.get("measured_step_s") is None:
        raise click.ClickException(f"the auto run chose no mapping early enough to measure it ({auto}): raise --steps")
    predicted = {label(r["mapping"]): r["predicted_step_s"] for r in auto["ranking"]}

    from rich.console import Console
    from rich.table import Table

    ranked = sorted(measured, key=measured.get)
    chosen = label(auto["mapping"])
    table = Table(title="every mapping, ranked by measured step time (emulated s; 2 H800 + 2 H20, EMULATED)")
    for col in ("rank", "mapping", "measured s/step", "predicted s/step", "prediction error"):
        table.add_column(col, justify="right" if col != "mapping" else "left")
    for i, name in enumerate(ranked, 1):
        p = predicted.get(name)
        table.add_row(str(i), name + ("  ← auto" if name == chosen else ""), f"{measured[name]:.1f}", f"{p:.1f}" if p else "—",
                      f"{(p - measured[name]) / measured[name]:+.0%}" if p else "—")
    Console(width=150).print(table)
    best = ranked[0]
    console.print(f"auto chose [bold]{chosen}[/bold] (rank {ranked.index(chosen) + 1} of {len(ranked)} by measured step time) at step "
                  f"{auto['applied_at_step']}; after the switch it ran {auto['measured_step_s']:.1f} s/step over {auto['steps_measured']} "
                  f"steps, the best hand mapping ({best}) {measured[best]:.1f}: ratio {auto['measured_step_s'] / measured[best]:.2f}")
    console.print(f"its printed prediction {auto['predicted_step_s']:.1f} s/step (simulated {auto['simulated_step_s']:.1f} × the runtime "
                  f"factor {auto['runtime_factor']:.2f} measured before the switch) against the {auto['measured_step_s']:.1f} measured: "
                  f"error {auto['error']:+.1%}")
    (out / "summary.json").write_text(json.dumps({"measured": measured, "auto": auto}, indent=2))


if __name__ == "__main__":
    main()
