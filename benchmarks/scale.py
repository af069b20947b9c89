"""The runtime at the paper's scale, on EMULATED hardware: the multi-task workload (flows/ablations/workloads/
multitask.yaml, calibrated) on a cluster shaped like the paper's evaluation (96 H800 + 32 H20, batch 512,
group 8) and like its production (≥ 1,000 GPUs, train : generation 1 : 5, ≥ 4,096 trajectories in flight),
many emulated instances per engine worker, eager α = 1.

Per shape it prints the measured step time and throughput beside the same policy simulated with a
zero-cost runtime (emulation/simulate.py) and the ideal (flow_ideal), the trained mix, the CPU the client
and the scheduler spent per emulated second, and what a call waited beyond its own service time — as a
share of that service time, which the time scale must keep under 5% (the wall clock stretches the
emulated one: too small a time scale magnifies every per-call cost).

``--sweep`` grows the trajectories in flight 64 → 4,096 on the production cluster (batches of 4 … 256
groups; eager α = 1 keeps up to two batches in flight) and plots, per point, the per-call wait beyond
service, throughput as a fraction of the simulated policy, and client / scheduler CPU (sweep.png).

Envs live on CPU workers of 512 env threads each (data/envhost.py): a shape gets one CPU worker per 512
trajectories it may hold in flight, as a CPU cluster gets hosts — one worker for 4,096 envs queued their
calls for seconds.

    python benchmarks/scale.py                                   # both shapes
    python benchmarks/scale.py --shape paper --time-scale 0.5 --steps 6
    python benchmarks/scale.py --sweep --steps 4 --warmup 1 --time-scale 0.5 --time-scale 0.5 --time-scale 0.5 --time-scale 1.0
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
ENV_THREADS = 512  # per CPU worker (EnvHost's pool)

# GPUs per pool; each engine worker of a pool stands for all of that pool's instances (one worker per pool).
SHAPES = {
    # the paper's evaluation cluster: 96 H800 + 32 H20 in all, batch 512 (64 groups of 8); train:generation ASSUMED 1:3
    "paper": {"H800": 64, "H20": 32, "train": 32, "batch_groups": 64},
    # production-like: 1,056 GPUs, train:generation 1:5 (paper: production), 2,048 per batch (≤ 4,096 in flight at α = 1)
    "production": {"H800": 440, "H20": 440, "train": 176, "batch_groups": 256},
}
SWEEP_GROUPS = (4, 16, 64, 256)  # at α = 1 eager: ≤ 64, 256, 1,024, 4,096 trajectories in flight


def shape_flow(shape: str, steps: int, time_scale: float, extra: list[str], batch_groups: int | None = None):
    s = SHAPES[shape]
    groups = batch_groups or s["batch_groups"]
    data = yaml.safe_load(WORKLOAD.read_text())
    cfg = load_flow(
        data=data,
        overrides=[
            "rollout.mode=rollart",
            "rollout.alpha=1",
            "rollout.admission=eager",
            f"rollout.batch_groups={groups}",
            f"emulation.pools.H800.gpus={s['H800']}",
            f"emulation.pools.H20.gpus={s['H20']}",
            f"emulation.trainer.gpus={s['train']}",
            f"emulation.time_scale={time_scale}",
            f"trainer.steps={steps}",
            "observe.watchdog_s=900",
            *extra,
        ],
    )
    in_flight = 2 * cfg.rollout.batch_groups * cfg.rollout.group_size  # eager α = 1: two batches beyond those trained
    cpu = [w for w in cfg.cluster.workers if w.pools == ["CPU"]][0]
    extra_cpu = [cpu.model_copy(update={"name": f"cpu-{i}"}) for i in range(1, -(-in_flight // ENV_THREADS))]
    cfg.cluster.workers = [*cfg.cluster.workers, *extra_cpu]
    return cfg


async def measure(cfg, out: Path) -> dict:
    t = await timed_run(cfg, out)  # the control-plane benchmark's run, CPU counted the same way
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    emulated_s = t["wall_s"] / cfg.emulation.time_scale
    (client0, _, sched0), (client1, _, sched1) = t["cpu_before"], t["cpu_after"]
    return {
        "rows": rows,
        "wall_s": t["wall_s"],
        "client_cpu_per_emulated_s": (client1 - client0) / emulated_s,
        "scheduler_cpu_per_emulated_s": (sched1 - sched0) / emulated_s,
        "client_cpu_share": (client1 - client0) / t["wall_s"],
        "scheduler_cpu_share": (sched1 - sched0) / t["wall_s"],
    }


def point(shape: str, steps: int, warmup: int, time_scale: float, out: Path, overrides: list[str], batch_groups: int | None = None) -> dict:
    cfg = shape_flow(shape, steps, time_scale, overrides, batch_groups)
    s = SHAPES[shape]
    cpus = sum(1 for w in cfg.cluster.workers if w.pools == ["CPU"])
    console.print(
        f"[bold]{shape}[/bold]: {s['H800']} H800 + {s['H20']} H20 generating, {s['train']} H800 training, "
        f"{cfg.rollout.batch_groups * 8} trajectories per batch, {cpus} CPU workers, time scale {time_scale} "
        f"[yellow](EMULATED hardware)[/yellow]"
    )
    r = asyncio.run(measure(cfg, out))
    m = summarise(r["rows"], time_scale, warmup)
    sim, ideal = simulated_of(cfg, warmup, seeds=2), ideal_of(cfg)
    waited, inside = m["call_overhead_ms"], m["call_service_ms"]
    return {
        "shape": shape,
        **s,
        "batch_groups": cfg.rollout.batch_groups,
        "per_batch": cfg.rollout.batch_groups * cfg.rollout.group_size,
        "in_flight_max": 2 * cfg.rollout.batch_groups * cfg.rollout.group_size,
        "cpu_workers": cpus,
        "time_scale": time_scale,
        "measured": m,
        "simulated": sim,
        "ideal": ideal,
        "overhead_share": {k: waited[k] / inside[k] for k in waited if inside.get(k)},
        **{
            k: r[k]
            for k in ("wall_s", "client_cpu_per_emulated_s", "scheduler_cpu_per_emulated_s", "client_cpu_share", "scheduler_cpu_share")
        },
    }


def table(title: str, results: list[dict]):
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "shape",
        "GPUs",
        "in flight ≤",
        "time scale",
        "step s: ours / sim / ideal",
        "ours / sim",
        "traj/s: ours / sim",
        "swe trained: ours / sim",
        "call wait beyond service, ms (share of service)",
        "CPU share of wall: client / scheduler",
        "wall s",
    ):
        t.add_column(col, overflow="fold")
    for x in results:
        m, sim, i = x["measured"], x["simulated"], x["ideal"]
        t.add_row(
            x["shape"],
            f"{x['H800'] + x['H20'] + x['train']}",
            f"{x['in_flight_max']}",
            f"{x['time_scale']}",
            f"{m['step_s']:.1f} / {sim['step_s']:.1f} / {i['step_s']:.1f}",
            f"{sim['step_s'] / m['step_s']:.2f}",
            f"{m['throughput']:.2f} / {sim['throughput']:.2f}",
            f"{m['trained_mix'].get('swe', 0):.2f} / {sim['trained_mix'].get('swe', 0):.2f}",
            ", ".join(f"{k} {m['call_overhead_ms'][k]:.0f} ({x['overhead_share'].get(k, 0):.1%})" for k in m["call_overhead_ms"]),
            f"{x['client_cpu_share']:.2f} / {x['scheduler_cpu_share']:.2f}",
            f"{x['wall_s']:.0f}",
        )
    console.print(t)


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    x = [r["in_flight_max"] for r in results]
    fig = Figure(figsize=(13, 4))
    a, b, c = fig.subplots(1, 3)
    for stage in ("generate", "env-step", "env-reset"):
        a.plot(x, [100 * r["overhead_share"].get(stage, 0) for r in results], "o-", label=stage)
    a.axhline(5, color="gray", ls="--", lw=1)
    a.set(xscale="log", xlabel="trajectories in flight (at most)", ylabel="wait beyond service, % of service", title="per-call cost")
    a.legend()
    b.plot(x, [r["measured"]["throughput"] / r["simulated"]["throughput"] for r in results], "o-", label="ours / simulated")
    b.plot(x, [r["measured"]["throughput"] / r["ideal"]["throughput"] for r in results], "s--", label="ours / ideal")
    b.axhline(0.9, color="gray", ls="--", lw=1)
    b.set(xscale="log", xlabel="trajectories in flight (at most)", ylabel="throughput fraction", title="throughput vs its bounds")
    b.legend()
    c.plot(x, [r["client_cpu_share"] for r in results], "o-", label="client")
    c.plot(x, [r["scheduler_cpu_share"] for r in results], "s-", label="scheduler")
    c.set(xscale="log", xlabel="trajectories in flight (at most)", ylabel="CPU seconds per wall second", title="control-plane CPU")
    c.legend()
    fig.suptitle("production cluster (1,056 EMULATED GPUs), eager α=1, multi-task workload — 2 cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--shape", "shapes", multiple=True, type=click.Choice(sorted(SHAPES)), default=("paper", "production"), show_default=True)
@click.option("--sweep", is_flag=True, help="production cluster, 64 → 4,096 trajectories in flight: a table and sweep.png")
@click.option("--steps", default=6, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option(
    "--time-scale",
    "time_scales",
    multiple=True,
    type=float,
    default=(0.5,),
    show_default=True,
    help="wall seconds per emulated second; with --sweep one per point in order (the last repeats): the larger the "
    "load, the larger it must be to keep a call's wait under 5% of its service",
)
@click.option("--out", default="runs/bench-scale", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
def main(shapes, sweep, steps, warmup, time_scales, out, overrides):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if sweep:
        scales = [*time_scales, *[time_scales[-1]] * len(SWEEP_GROUPS)][: len(SWEEP_GROUPS)]
        results = [
            point("production", steps, warmup, ts, out / f"sweep-{g}", list(overrides), batch_groups=g)
            for g, ts in zip(SWEEP_GROUPS, scales)
        ]
        table("in flight 64 → 4,096 on the production cluster (EMULATED hardware, eager α=1; 2 cores)", results)
        plot(results, out / "sweep.png")
        (out / "sweep.json").write_text(json.dumps(results, indent=2, default=str))
        console.print(f"plot: {(out / 'sweep.png').resolve()}")
        return
    results = [point(shape, steps, warmup, time_scales[0], out / shape, list(overrides)) for shape in shapes]
    table("the runtime at scale (EMULATED hardware, eager α=1, multi-task workload; 2 cores)", results)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
