"""`rollart` command line: run flows, bring up the local pools."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import click

from rollart_dask.config import FlowError, load_flow
from rollart_dask.entry.cli_envs import envs
from rollart_dask.entry.cli_runs import eval_command, merge, replay_diff, report_command, runs_command
from rollart_dask.entry.cli_services import cluster, rewards
from rollart_dask.entry.scaffold import init_command


@click.group()
def main():
    """rollart-dask: agentic RL with disaggregated, trajectory-level asynchronous rollout on Dask."""
    # Dask's INFO chatter (workers starting/closing) drowns the run's output; workers inherit this.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    logging.basicConfig(level=logging.WARNING)


@main.command()
@click.argument("flow", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a flow key, e.g. --set rollout.alpha=2")
@click.option(
    "--scheduler",
    default=None,
    metavar="ADDR",
    help="attach to an existing Dask scheduler (tcp://host:8786, or tls://host:8786 with the flow's cluster.security)",
)
@click.option("--out", default=None, type=click.Path(file_okay=False), help="output directory (default runs/<flow>-<time>)")
@click.option("--resume", is_flag=True, help="continue from the latest checkpoint in --out")
def run(flow, overrides, scheduler, out, resume):
    """Run FLOW (a YAML flow file, or a Python flow file that builds one: flows/declared/corridor_flow.py) and train."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollart_dask.control.buffer import OUTCOMES
    from rollart_dask.algo.heldout import is_complete, played_as, shown
    from rollart_dask.entry.api import run_sync
    from rollart_dask.observe import console, summary_table

    try:
        cfg = load_flow(flow, [*overrides, *([f"cluster.scheduler={scheduler}"] if scheduler else [])])
    except FlowError as e:
        raise click.ClickException(str(e))
    if resume and not out:
        raise click.ClickException("--resume needs --out DIR (the run to continue)")
    out_dir = Path(out or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not resume and (out_dir / "metrics.jsonl").exists():
        raise click.ClickException(f"{out_dir} already holds a run (metrics.jsonl); pass --resume to continue it, or choose another --out")
    r = cfg.rollout
    console.print(
        f"[bold]{cfg.name}[/bold]: mode={r.mode} level={r.level} alpha={r.alpha} G={r.group_size} r={r.redundancy} "
        f"batch={r.batch_groups} groups, engine={cfg.engine.backend}, out={out_dir}"
    )
    progress = Progress(
        TextColumn("[bold]train[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=not cfg.observe.progress,
    )
    bar = progress.add_task("", total=cfg.trainer.steps)

    printed = set()

    def on_step(run_):
        ev = run_.history[-1]
        desc = escape(" ".join(f"{k}={shown(v, 2)}" for k, v in ev["eval"].items()))  # an incomplete one: its note, no score
        progress.update(bar, completed=run_.published, description=f"held-out@v{ev['version']}: {desc}")
        if not console.is_terminal and ev["version"] not in printed:  # a log file gets one line per evaluation
            printed.add(ev["version"])
            console.print(f"v{run_.published} held-out@v{ev['version']}: {desc}")

    try:
        with progress:
            result = run_sync(cfg, out_dir, resume=resume, on_step=on_step)
    except FlowError as e:
        raise click.ClickException(str(e))
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the run stopped, its cluster closed
        console.print(
            f"[yellow]{e or 'stopped by Ctrl-C'}: metrics so far in {out_dir / 'metrics.jsonl'}; "
            f"`rollart run {flow} --out {out_dir} --resume` continues from the latest checkpoint[/yellow]"
        )
        raise SystemExit(130) from None
    except Exception as e:
        partial = getattr(e, "partial", None)
        if partial is None:  # failed before it ran (set-up): nothing to write
            raise
        (out_dir / "summary.json").write_text(json.dumps(partial, indent=2, default=str))
        kept = f"\nmetrics: {out_dir / 'metrics.jsonl'}\nsummary: {out_dir / 'summary.json'}\ncheckpoint: {partial['checkpoint'] or 'none'}"
        raise click.ClickException(f"the run stopped after {partial['steps']} steps: {e}{kept}") from None
    first, last = result["first"], result["last"]
    rows = []
    for task in first["eval"]:
        fa, fb = first["eval"][task], last["eval"][task]
        both = f"{shown(fa)} (v{first['version']}) → {shown(fb)} (v{last['version']})"
        delta = (
            f"  Δ {fb['success'] - fa['success']:+.3f}" if is_complete(fa) and is_complete(fb) else ""
        )  # never built on an incomplete one
        rows.append((f"held-out {task} success ({played_as(last.get('temperature'))})", escape(both) + delta))
    if cfg.warmstart.steps and not resume:
        rows.append(("warm start", f"{cfg.warmstart.steps} imitation steps before v{first['version']}: Δ above is RL's alone"))
    rows += [
        ("steps", str(result["steps"])),
        ("wall time", f"{result['wall_s']:.0f} s"),
        ("checkpoint", Path(result["checkpoint"]).name + " (its full path below)"),
    ]
    w = result["weights"]
    if w.get("transfers"):
        what = "LoRA adapter: " if w.get("adapter") else ""
        rows.append(
            (
                f"weights ({w['store']} store)",
                f"{what}{w['bytes'] / 2**20:.2f} MiB in {w['buckets']} bucket(s) to {w['engines']} engine(s): "
                f"publish {w['publish_s']:.3f} s, transfer {w['transfer_s']:.3f} s, waited for before Suspend {w['waited_s']:.3f} s "
                f"({w['hidden_fraction']:.0%} hidden behind rollout)"
                + (
                    f"; as deltas of {w['delta_bytes'] / 2**20:.2f} MiB on average ({w['delta_pulls']:.0%} of the pulls)"
                    if w.get("delta_bytes")
                    else ""
                ),
            )
        )
    pl = result.get("placement")
    if pl and pl.get("measured_step_s"):  # affinity auto, rollout.pd auto (control/placement.py)
        from rollart_dask.control.placement import describe

        rows.append(
            (
                "placement (auto)",
                f"{describe(pl, cfg.rollout.pd == 'auto')} from step {pl['applied_at_step']}: predicted {pl['predicted_step_s']:.1f}, "
                f"measured {pl['measured_step_s']:.1f} emulated s/step over {pl['steps_measured']} steps ({pl['error']:+.0%})",
            )
        )
    if result.get("pd"):  # prefill/decode disaggregation (rollout.pd)
        pdm = result["pd"]
        route = cfg.rollout.pd_route.model_dump() if cfg.rollout.pd_route else (pl or {}).get("pd")
        rows.append(
            (
                f"pd ({route['prefill']} → {route['decode']})" if route else "pd (auto: off)",
                f"{pdm['kv_bytes_shipped'] / 2**20:.1f} MiB of KV shipped; {pdm['prefill_requests']} requests prefilled "
                f"({pdm['prefill_s']:.2f} engine s), {pdm['decode_requests']} decoded ({pdm['decode_s']:.2f} engine s); "
                f"re-prefilled {pdm['reprefilled']}",
            )
        )
    t = result.get("rollout_tokens") or {}
    if t.get("generated"):
        rows.append(
            (
                "response tokens",
                f"{t['generated']} generated, {t['trained']} trained ({t['wasted_share']:.1%} wasted: stale, redundant, "
                f"failed, in flight); {t['discarded']} of interrupted turns discarded, {t['continued']} continued "
                f"(rollout.partial={cfg.rollout.partial})",
            )
        )
    a = result.get("accounting")
    if a:
        ends = ", ".join(f"{a[k]} {k.replace('_', ' ')}" for k in OUTCOMES if a[k])
        lost = a["unaccounted"] + a["conflicts"] + a["trained_twice"] + a["trained_without_reward"]
        rows.append(
            (
                "trajectories",
                f"{a['launched']} launched: {ends}; "
                + (
                    "nothing lost"
                    if not lost
                    else f"[red]{a['unaccounted']} unaccounted, {a['conflicts']} with two outcomes, {a['trained_twice']} trained twice, "
                    f"{a['trained_without_reward']} trained without a reward[/red]"
                ),
            )
        )
    rows += [(k, str(v)) for k, v in sorted(result["counts"].items())]
    console.print(summary_table(f"{cfg.name} — summary", rows))
    (out_dir / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    files = {
        "checkpoint": Path(result["checkpoint"]),
        "metrics": out_dir / "metrics.jsonl",
        "summary": out_dir / "summary.json",
        **({"tensorboard": out_dir / "tensorboard"} if cfg.observe.tensorboard else {}),
    }
    for what, path in files.items():  # whole, never folded by the table: to copy into `rollart eval`, a notebook, a shell
        console.print(f"{what + ':':12s} {path.resolve()}", soft_wrap=True, highlight=False)


@main.command()
@click.argument("flow", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a flow key, as for `rollart run`")
@click.option("--scheduler", default=None, metavar="ADDR", help="attach to an existing Dask scheduler (default: the flow's cluster)")
def check(flow, overrides, scheduler):
    """The run's pre-flight without training: each task's env plays one episode (its expert's actions, else its first
    allowed action) and its reward is called on it, as the run would; every problem found is listed (non-zero exit)."""
    import tempfile

    from rollart_dask.entry.check import preflight_flow

    try:
        cfg = load_flow(flow, [*overrides, *([f"cluster.scheduler={scheduler}"] if scheduler else [])])
        with tempfile.TemporaryDirectory(prefix="rollart-check-") as out:
            found = asyncio.run(preflight_flow(cfg, Path(out)))
    except FlowError as e:
        raise click.ClickException(str(e))
    for task, r in found.items():
        click.echo(f"task {task}: env played {r['turns']} turn(s); reward {r['reward'].get('score')} ({r['reward']})")
    click.echo(f"pre-flight passed: {len(found)} task(s)")


@main.command()
@click.argument("flow", type=click.Path(dir_okay=False))
@click.option("--scenario", default="all", show_default=True, help="a scenario name, or all (the baseline always runs first)")
@click.option("--steps", default=6, show_default=True, help="training steps per run")
@click.option("--seed", default=0, show_default=True, help="seed of the fault schedule")
@click.option("--out", default="runs/chaos", show_default=True, type=click.Path(file_okay=False), help="one folder per scenario under it")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a flow key in every scenario")
@click.option(
    "--own-clusters", is_flag=True, help="every scenario on its own embedded cluster (by default those that leave it as found share one)"
)
def chaos(flow, scenario, steps, seed, out, overrides, own_clusters):
    """Inject faults into real runs of FLOW on the embedded default and show that nothing is lost: per scenario, the
    faults, whether the run completed, samples lost, steps redone, slowdown against the fault-free run, leaks."""
    from rollart_dask.observe import console
    from rollart_dask.tools.chaos.runner import TINY
    from rollart_dask.tools.chaos.scenarios import select
    from rollart_dask.tools.chaos.suite import markdown, run_suite, table

    try:
        base = load_flow(flow, list(overrides))
        scenarios = select(scenario)
    except (FlowError, ValueError) as e:
        raise click.ClickException(str(e))
    if base.cluster.scheduler:
        raise click.ClickException("rollart chaos kills and adds workers of the embedded cluster: run it without cluster.scheduler")
    budget = tuple(b for b in TINY if not b.startswith("trainer.steps=")) + (f"trainer.steps={steps}",)
    out_dir = Path(out)
    rows = run_suite(base, scenarios, out_dir, seed=seed, budget=budget, echo=console.print, share_cluster=not own_clusters)
    console.print(table(rows))
    (out_dir / "table.md").write_text(markdown(rows))
    console.print(f"results: {out_dir / 'results.json'}, {out_dir / 'table.md'}")
    bad = [
        r["scenario"]
        for r in rows
        if not r.get("completed")
        or r.get("samples_lost")
        or r.get("leaked_envs")
        or r.get("leaked_processes")
        or r.get("leaked_containers")
        or r.get("inject_errors")
    ]
    if bad:
        raise click.ClickException(f"scenarios that lost, leaked or failed: {', '.join(bad)}")


@main.command()
@click.argument("name")
@click.option("--quick", is_flag=True, help="the short versions (all of them together: under 15 minutes on 2 cores)")
@click.option("--tiny", is_flag=True, help="the smallest that still measures (the test suite's)")
@click.option(
    "--out", default="runs/ablations", show_default=True, type=click.Path(file_okay=False), help="one folder per ablation under it"
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="override a flow key in every variant")
@click.option(
    "--report-only",
    is_flag=True,
    help="report the runs already under --out again (ideal, simulation and cost recomputed with the code of today), running nothing",
)
def ablate(name, quick, tiny, out, overrides, report_only):
    """Run ablation NAME (a file in flows/ablations/, or 'all') on EMULATED hardware: every variant side by side,
    reported beside the paper and beside its own ideal (results.csv, results.md, results.png).
    'calibrate' checks the paper's facts about the workload (Fig. 3–6) on it instead; 'all' does that first."""
    from rollart_dask.tools.ablation import ablation_names, load_ablation, run_ablation
    from rollart_dask.tools.ablation.calibrate import calibrate, print_facts

    t0 = time.monotonic()
    if name in ("calibrate", "all"):
        try:
            facts = calibrate()
        except FlowError as e:
            raise click.ClickException(str(e))
        print_facts(facts)
        wrong = [f"{f.figure}: {f.claim} (the workload gives {f.measured})" for f in facts if not f.holds]
        if wrong:
            raise click.ClickException(
                "the workload does not hold the paper's facts; mend flows/ablations/workloads/ before measuring "
                "any figure:\n  " + "\n  ".join(wrong)
            )
        if name == "calibrate":
            return
    names = ablation_names() if name == "all" else [name]
    try:
        specs = [load_ablation(n) for n in names]
        for (spec, path), n in zip(specs, names):
            target = Path(out) / Path(n).stem
            run_ablation(spec, path, target, quick=quick, tiny=tiny, extra=list(overrides), report_only=report_only)
            click.echo((target / "results.md").read_text())
    except FlowError as e:
        raise click.ClickException(str(e))
    click.echo(f"{len(names)} ablation(s) in {time.monotonic() - t0:.0f} s; reports under {out}/")


main.add_command(eval_command)
main.add_command(merge)
main.add_command(runs_command)
main.add_command(report_command)
main.add_command(replay_diff)
main.add_command(envs)
main.add_command(init_command)
main.add_command(rewards)
main.add_command(cluster)


if __name__ == "__main__":
    main()
