"""The runtime at the paper's scale, on EMULATED hardware: the multi-task workload (flows/ablations/workloads/
multitask.yaml, calibrated) on a cluster shaped like the paper's evaluation (96 H800 + 32 H20, batch 512,
group 8) and like its production (≥ 1,000 GPUs, train : generation 1 : 5, ≥ 4,096 trajectories in flight),
many emulated instances per engine worker, eager α = 1.

Per shape it prints the measured step time and throughput beside the same policy simulated with a
zero-cost runtime (emulation/simulate.py) and the ideal (flow_ideal), the trained mix, the CPU the client
and the scheduler spent per emulated second, and what a call waited beyond its own service time — as a
share of that service time, which the time scale must keep under 5% (the wall clock stretches the
emulated one: too small a time scale magnifies every per-call cost).

    python benchmarks/scale.py                                   # both shapes
    python benchmarks/scale.py --shape paper --time-scale 0.5 --steps 6
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click
import yaml

from rollart_dask.config import load_flow
from rollart_dask.observe import console
from rollart_dask.tools.ablation.measure import ideal_of, simulated_of, summarise

from control_plane import timed_run  # (benchmarks/ is the script's own folder)

WORKLOAD = Path(__file__).resolve().parents[1] / "flows" / "ablations" / "workloads" / "multitask.yaml"

# GPUs per pool; each engine worker of a pool stands for all of that pool's instances (one worker per pool).
SHAPES = {
    # the paper's evaluation cluster: 96 H800 + 32 H20 in all, batch 512 (64 groups of 8); train:generation ASSUMED 1:3
    "paper": {"H800": 64, "H20": 32, "train": 32, "batch_groups": 64},
    # production-like: 1,056 GPUs, train:generation 1:5 (paper: production), 2,048 per batch (≤ 4,096 in flight at α = 1)
    "production": {"H800": 440, "H20": 440, "train": 176, "batch_groups": 256},
}


def shape_flow(shape: str, steps: int, time_scale: float, extra: list[str]):
    s = SHAPES[shape]
    return load_flow(data=yaml.safe_load(WORKLOAD.read_text()), overrides=[
        "rollout.mode=rollart", "rollout.alpha=1", "rollout.admission=eager", f"rollout.batch_groups={s['batch_groups']}",
        f"emulation.pools.H800.gpus={s['H800']}", f"emulation.pools.H20.gpus={s['H20']}", f"emulation.trainer.gpus={s['train']}",
        f"emulation.time_scale={time_scale}", f"trainer.steps={steps}", "observe.watchdog_s=900", *extra])


async def measure(cfg, out: Path) -> dict:
    t = await timed_run(cfg, out)  # the control-plane benchmark's run, CPU counted the same way
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    emulated_s = t["wall_s"] / cfg.emulation.time_scale
    (client0, _, sched0), (client1, _, sched1) = t["cpu_before"], t["cpu_after"]
    return {"rows": rows, "wall_s": t["wall_s"], "client_cpu_per_emulated_s": (client1 - client0) / emulated_s,
            "scheduler_cpu_per_emulated_s": (sched1 - sched0) / emulated_s}


@click.command()
@click.option("--shape", "shapes", multiple=True, type=click.Choice(sorted(SHAPES)), default=("paper", "production"), show_default=True)
@click.option("--steps", default=6, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--time-scale", "time_scale", default=0.5, show_default=True, help="wall seconds per emulated second")
@click.option("--out", default="runs/bench-scale", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
def main(shapes, steps, warmup, time_scale, out, overrides):
    from rich.table import Table

    results = []
    for shape in shapes:
        cfg = shape_flow(shape, steps, time_scale, list(overrides))
        s = SHAPES[shape]
        console.print(f"[bold]{shape}[/bold]: {s['H800']} H800 + {s['H20']} H20 generating, {s['train']} H800 training, "
                      f"{s['batch_groups'] * 8} trajectories per batch, time scale {time_scale} [yellow](EMULATED hardware)[/yellow]")
        r = asyncio.run(measure(cfg, Path(out) / shape))
        m = summarise(r["rows"], time_scale, warmup)
        sim, ideal = simulated_of(cfg, warmup, seeds=2), ideal_of(cfg)
        waited, inside = m["call_overhead_ms"], m["call_service_ms"]
        share = {k: waited[k] / inside[k] for k in waited if inside.get(k)}
        results.append({"shape": shape, **s, "per_batch": cfg.rollout.batch_groups * cfg.rollout.group_size, "time_scale": time_scale, "measured": m, "simulated": sim, "ideal": ideal,
                        "overhead_share": share, "wall_s": r["wall_s"], "client_cpu_per_emulated_s": r["client_cpu_per_emulated_s"],
                        "scheduler_cpu_per_emulated_s": r["scheduler_cpu_per_emulated_s"]})
    table = Table(title="the runtime at scale (EMULATED hardware, eager α=1, multi-task workload; 2 cores)")
    for col in ("shape", "GPUs", "per batch", "step s: ours / sim / ideal", "ours / sim", "traj/s: ours / sim",
                "swe trained: ours / sim", "call wait beyond service, ms (share of service)", "CPU per emulated s: client / scheduler", "wall s"):
        table.add_column(col, overflow="fold")
    for x in results:
        m, sim, i = x["measured"], x["simulated"], x["ideal"]
        table.add_row(x["shape"], f"{x['H800'] + x['H20'] + x['train']}", f"{x['per_batch']}",
                      f"{m['step_s']:.1f} / {sim['step_s']:.1f} / {i['step_s']:.1f}", f"{sim['step_s'] / m['step_s']:.2f}",
                      f"{m['throughput']:.2f} / {sim['throughput']:.2f}",
                      f"{m['trained_mix'].get('swe', 0):.2f} / {sim['trained_mix'].get('swe', 0):.2f}",
                      ", ".join(f"{k} {m['call_overhead_ms'][k]:.0f} ({x['overhead_share'].get(k, 0):.1%})" for k in m["call_overhead_ms"]),
                      f"{x['client_cpu_per_emulated_s']:.3f} / {x['scheduler_cpu_per_emulated_s']:.3f}", f"{x['wall_s']:.0f}")
    console.print(table)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
