"""`affinity: auto` against every hand-written mapping, on the EMULATED multi-task workload, in one command.

FrozenLake (prefill-heavy) and GEM-Math (decode-heavy) from flows/ablations/workloads/multitask.yaml on
2 EMULATED H800 + 2 EMULATED H20 GPUs (small pools, so that where each task generates matters). Every
mapping — each task on prefill (H800), decode (H20) or any (either) — runs on a fresh embedded cluster and
its step time is measured (after 2 warm-up steps); then one run with both tasks on `affinity: auto`
measures the tasks for `placement.profile_steps`, predicts every mapping on the measured profile and takes
the fastest. Prints every mapping ranked by measured step time beside its prediction, which one auto
chose, the step time auto reached after the switch against the best hand mapping's, and the error of the
prediction it printed.

With ``--pd`` the same for `rollout.pd: auto`, on flows/ablations/workloads/long_prompts.yaml (16k-token
prompts, 300–600-token answers, 1 H800 + 1 H20): no disaggregation and both routes run by hand, then one
run that starts undisaggregated, measures the tasks and takes the route (or none) predicted fastest.

    python benchmarks/auto_affinity.py              # ~14 min on 2 cores
    python benchmarks/auto_affinity.py --steps 12   # a quicker, noisier look
    python benchmarks/auto_affinity.py --pd         # rollout.pd: auto
"""

from __future__ import annotations

import collections
import itertools
import json
import shutil
import statistics
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
PD_WORKLOAD = Path("flows/ablations/workloads/long_prompts.yaml")  # 1 H800 + 1 H20, both tasks on any, rollout.pd: auto
ROUTES = (None, ("H800", "H20"), ("H20", "H800"))
WARMUP = 2


def flow(workload: Path, steps: int, extra: list[str], tasks=None):
    data = yaml.safe_load(workload.read_text())
    if tasks:
        data["tasks"] = [t for t in data["tasks"] if t["name"] in tasks]
    return load_flow(data=data, overrides=[f"trainer.steps={steps}", *extra])


def label(mapping: dict[str, str], pd: dict | None = None) -> str:
    where = ", ".join(f"{t} {a}" for t, a in mapping.items())
    return f"pd {pd['prefill']} → {pd['decode']}" if pd else where or "pd off"


def choices(pd: bool) -> list[tuple[str, list[str]]]:
    """Every hand-written choice, as (label, flow overrides): the 9 affinity mappings, or with --pd the three routes."""
    if pd:
        return [
            (
                label({}, r and {"prefill": r[0], "decode": r[1]}),
                [f"rollout.pd={{prefill: {r[0]}, decode: {r[1]}}}" if r else "rollout.pd=null"],
            )
            for r in ROUTES
        ]
    return [
        (label(dict(zip(TASKS, combo))), [*SMALL_POOLS, *(f"tasks.{t}.affinity={a}" for t, a in zip(TASKS, combo))])
        for combo in itertools.product(("prefill", "decode", "any"), repeat=len(TASKS))
    ]


def run_choice(cfg, run_dir: Path) -> float:
    run_sync(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return summarise(rows, cfg.emulation.time_scale, WARMUP)["step_s"]


@click.command()
@click.option("--steps", default=18, show_default=True, help="training steps per run")
@click.option("--pd", is_flag=True, help="rollout.pd: auto on the long-prompt workload, against no PD and either route")
@click.option("--repeats", default=1, show_default=True, help="rounds of every choice and one auto run, flow seed = round")
@click.option("--out", default="runs/bench-auto-affinity", show_default=True)
@click.option("--set", "overrides", multiple=True, help="flow overrides for every run (key=value)")
def main(steps, pd, repeats, out, overrides):
    out = Path(out) / ("pd" if pd else "affinity")
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: fresh runs only
    workload, tasks = (PD_WORKLOAD, None) if pd else (WORKLOAD, TASKS)
    auto_keys = ["rollout.pd=auto"] if pd else [*SMALL_POOLS, *(f"tasks.{t}.affinity=auto" for t in TASKS)]
    measured: dict[str, list[float]] = {name: [] for name, _ in choices(pd)}
    autos: list[dict] = []
    for r in range(repeats):  # a round's runs draw the same trajectories (seed r): its choices compare on equal work
        for i, (name, keys) in enumerate(choices(pd)):
            console.print(f"[bold]{name}[/bold] (round {r + 1}/{repeats}): {steps} steps [yellow](EMULATED hardware)[/yellow]")
            measured[name].append(
                run_choice(flow(workload, steps, [*keys, f"seed={r}", *overrides], tasks), out / f"round-{r}" / f"choice-{i}")
            )
        cfg = flow(workload, steps, [*auto_keys, f"seed={r}", *overrides], tasks)
        console.print(
            f"[bold]{'rollout.pd' if pd else 'affinity'} auto[/bold] (round {r + 1}/{repeats}): {steps} steps "
            "[yellow](EMULATED hardware)[/yellow]"
        )
        auto = run_sync(cfg, out / f"round-{r}" / "auto")["placement"]
        if auto.get("applied_at_step") is None or auto.get("measured_step_s") is None:
            raise click.ClickException(f"the auto run chose nothing early enough to measure it ({auto}): raise --steps")
        autos.append({**auto, "chosen": label(auto["mapping"], auto.get("pd"))})

    from rich.console import Console
    from rich.table import Table

    median = {name: statistics.median(v) for name, v in measured.items()}
    predicted = {
        name: statistics.median(p)
        for name in median
        if (p := [row["predicted_step_s"] for a in autos for row in a["ranking"] if label(row["mapping"], row.get("pd")) == name])
    }
    ranked = sorted(median, key=median.get)
    picks = collections.Counter(a["chosen"] for a in autos)
    pools = f"{cfg.emulation.pools['H800'].gpus} H800 + {cfg.emulation.pools['H20'].gpus} H20"
    table = Table(
        title=f"every {'route' if pd else 'mapping'}, ranked by measured step time (emulated s; {pools}, EMULATED; "
        f"{repeats} round{'s' * (repeats > 1)})"
    )
    for col in (
        "rank",
        "choice",
        "measured s/step" + (" (median; range)" if repeats > 1 else ""),
        "predicted s/step",
        "prediction error",
        "auto chose it",
    ):
        table.add_column(col, justify="right" if col != "choice" else "left")
    for i, name in enumerate(ranked, 1):
        p, v = predicted.get(name), measured[name]
        spread = f" ({min(v):.1f}–{max(v):.1f})" if repeats > 1 else ""
        table.add_row(
            str(i),
            name,
            f"{median[name]:.1f}{spread}",
            f"{p:.1f}" if p else "—",
            f"{(p - median[name]) / median[name]:+.0%}" if p else "—",
            f"{picks[name]}×" if picks[name] else "",
        )
    Console(width=160).print(table)
    best = ranked[0]
    for r, a in enumerate(autos):
        if a["chosen"] not in median:
            raise click.ClickException(f"auto chose {a['chosen']}, which no hand-written run measured")
        console.print(
            f"round {r + 1}: auto chose [bold]{a['chosen']}[/bold] (rank {ranked.index(a['chosen']) + 1} of {len(ranked)}) at step "
            f"{a['applied_at_step']}; after the switch {a['measured_step_s']:.1f} s/step over {a['steps_measured']} steps against the "
            f"best hand-written choice's ({best}) {median[best]:.1f}: ratio {a['measured_step_s'] / median[best]:.2f}"
            + (
                f" (the best's own rounds: {min(measured[best]) / median[best]:.2f}–{max(measured[best]) / median[best]:.2f})"
                if repeats > 1
                else ""
            )
        )
        console.print(
            f"  its printed prediction {a['predicted_step_s']:.1f} s/step (simulated {a['simulated_step_s']:.1f} × the runtime "
            f"factor {a['runtime_factor']:.2f} measured before the switch) against the {a['measured_step_s']:.1f} measured: "
            f"error {a['error']:+.1%}"
            + (
                f" (the measured mean's standard error ±{a['measured_se_s'] / a['measured_step_s']:.0%}; the steps after the switch "
                f"would give the factor {a['refit_factor']:.2f})"
                if a.get("measured_se_s")
                else ""
            )
        )
    (out / "summary.json").write_text(json.dumps({"measured": measured, "auto": autos}, indent=2))


if __name__ == "__main__":
    main()
