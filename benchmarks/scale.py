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
groups; eager α = 1 keeps up to two batches in flight), then 16,384 on the 3,072-GPU cluster (1,024 groups),
and plots, per point, the per-call wait beyond service, throughput as a fraction of the simulated policy,
and client / scheduler CPU (sweep.png). Each point keeps its result (point.json in its folder): ``--resume``
reuses those measured with the same shape, batch, time scale and steps.

Envs live on CPU workers (data/envhost.py; ``cluster.env_threads`` env calls each): a shape gets one CPU
worker per env_threads trajectories it may hold in flight, as a CPU cluster gets hosts — one worker of 512
threads for 4,096 envs queued their calls for seconds. The workload's call timeouts are stretched with
the time scale, so they bound the same emulated seconds at any.

    python benchmarks/scale.py                                   # both shapes
    python benchmarks/scale.py --shape paper --time-scale 0.5 --steps 6
    python benchmarks/scale.py --shape production-3k --steps 3 --warmup 1 --time-scale 4
    python benchmarks/scale.py --sweep --resume --steps 4 --steps 4 --steps 4 --steps 4 --steps 3 --warmup 1 --time-scale 0.5 --time-scale 0.5 --time-scale 0.5 --time-scale 1.0 --time-scale 4
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

# GPUs per pool, spread over ``engine_workers`` engine workers per pool (each stands for its share of the pool's
# instances: one driver thread per instance, so the largest shape splits its 2,560 over eight processes), and the env
# threads of each CPU worker (cluster.env_threads).
SHAPES = {
    # the paper's evaluation cluster: 96 H800 + 32 H20 in all, batch 512 (64 groups of 8); train:generation ASSUMED 1:3
    "paper": {"H800": 64, "H20": 32, "train": 32, "batch_groups": 64},
    # production-like: 1,056 GPUs, train:generation 1:5 (paper: production), 2,048 per batch (≤ 4,096 in flight at α = 1)
    "production": {"H800": 440, "H20": 440, "train": 176, "batch_groups": 256},
    # the paper's 3,000+ GPUs: 3,072, train:generation 1:5, 8,192 per batch (≤ 16,384 in flight at α = 1)
    "production-3k": {"H800": 1280, "H20": 1280, "train": 512, "batch_groups": 1024, "engine_workers": 4, "env_threads": 2048},
}
# (shape, batch groups) at α = 1 eager: ≤ 64, 256, 1,024, 4,096 trajectories in flight on 1,056 GPUs, 16,384 on 3,072
SWEEP = (("production", 4), ("production", 16), ("production", 64), ("production", 256), ("production-3k", 1024))


def shape_flow(shape: str, steps: int, time_scale: float, extra: list[str], batch_groups: int | None = None):
    s = SHAPES[shape]
    groups = batch_groups or s["batch_groups"]
    per_pool = s.get("engine_workers", 1)
    data = yaml.safe_load(WORKLOAD.read_text())
    # the workload's call timeouts are wall seconds at its own time scale: the same emulated bounds at this one (a
    # swe reset's 600 s tail must not time out because the wall clock was stretched)
    stretch = time_scale / data["emulation"]["time_scale"]
    timeouts = [f"rollout.{k}={data['rollout'][k] * stretch:g}" for k in ("env_timeout_s", "generate_timeout_s", "reward_timeout_s")]
    cfg = load_flow(
        data=data,
        overrides=[
            "rollout.mode=rollart",
            "rollout.alpha=1",
            "rollout.admission=eager",
            f"rollout.batch_groups={groups}",
            f"emulation.pools.H800.gpus={s['H800'] // per_pool}",  # (GPUs per engine worker)
            f"emulation.pools.H20.gpus={s['H20'] // per_pool}",
            *([f"cluster.env_threads={s['env_threads']}"] if "env_threads" in s else []),  # (else the default, 512)
            f"emulation.trainer.gpus={s['train']}",
            f"emulation.time_scale={time_scale}",
            f"trainer.steps={steps}",
            f"observe.watchdog_s={max(900, 900 * time_scale):g}",
            *timeouts,
            *extra,
        ],
    )
    in_flight = 2 * cfg.rollout.batch_groups * cfg.rollout.group_size  # eager α = 1: two batches beyond those trained

    def needed(w) -> int:  # workers like w the shape needs: env hosts for every trajectory in flight, engines per pool
        if w.pools == ["CPU"]:
            return -(-in_flight // cfg.cluster.env_threads)
        return per_pool if w.pools in (["H800"], ["H20"]) else 1

    copies = [w.model_copy(update={"name": w.name.replace("-0", f"-{i}")}) for w in cfg.cluster.workers for i in range(1, needed(w))]
    cfg.cluster.workers = [*cfg.cluster.workers, *copies]
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


def point(
    shape: str,
    steps: int,
    warmup: int,
    time_scale: float,
    out: Path,
    overrides: list[str],
    batch_groups: int | None = None,
    resume: bool = False,
) -> dict:
    cfg = shape_flow(shape, steps, time_scale, overrides, batch_groups)
    s = SHAPES[shape]
    kept = out / "point.json"
    asked = {
        "shape": shape,
        "batch_groups": cfg.rollout.batch_groups,
        "time_scale": time_scale,
        "steps": steps,
        "warmup": warmup,
        "overrides": overrides,
    }
    if resume and kept.is_file():
        before = json.loads(kept.read_text())
        if {k: before.get(k) for k in asked} == asked:
            console.print(f"[bold]{shape}[/bold], {asked['batch_groups']} groups per batch: kept from {kept}")
            return before
    cpus = sum(1 for w in cfg.cluster.workers if w.pools == ["CPU"])
    console.print(
        f"[bold]{shape}[/bold]: {s['H800']} H800 + {s['H20']} H20 generating on {s.get('engine_workers', 1)} engine worker(s) "
        f"per pool, {s['train']} H800 training, {cfg.rollout.batch_groups * 8} trajectories per batch, {cpus} CPU workers "
        f"of {cfg.cluster.env_threads} env threads, time scale {time_scale} [yellow](EMULATED hardware)[/yellow]"
    )
    r = asyncio.run(measure(cfg, out))
    m = summarise(r["rows"], time_scale, warmup)
    sim, ideal = simulated_of(cfg, warmup, seeds=2), ideal_of(cfg)
    waited, inside = m["call_overhead_ms"], m["call_service_ms"]
    result = {
        **s,
        **asked,
        "per_batch": cfg.rollout.batch_groups * cfg.rollout.group_size,
        "in_flight_max": 2 * cfg.rollout.batch_groups * cfg.rollout.group_size,
        "cpu_workers": cpus,
        "env_threads": cfg.cluster.env_threads,
        "measured": m,
        "simulated": sim,
        "ideal": ideal,
        "overhead_share": {k: waited[k] / inside[k] for k in waited if inside.get(k)},
        **{
            k: r[k]
            for k in ("wall_s", "client_cpu_per_emulated_s", "scheduler_cpu_per_emulated_s", "client_cpu_share", "scheduler_cpu_share")
        },
    }
    kept.write_text(json.dumps(result, indent=2, default=str))
    return result


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
    larger = [(r["in_flight_max"], r["H800"] + r["H20"] + r["train"]) for r in results if r["shape"] != "production"]
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
    for ax in (a, b, c):  # the points measured on a larger cluster
        for n, gpus in larger:
            ax.axvline(n, color="lightgray", lw=6, alpha=0.5, zorder=0)
            ax.annotate(f"{gpus:,} GPUs", (n, 0.02), xycoords=("data", "axes fraction"), ha="right", fontsize=8, color="gray")
    fig.suptitle(
        "1,056 EMULATED GPUs (production-like) up to 4,096 in flight, 3,072 at 16,384 (shaded); eager α=1, multi-task workload — 2 cores",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def per_point(values: tuple) -> list:
    """One value per sweep point, in order; the last repeats."""
    return [*values, *[values[-1]] * len(SWEEP)][: len(SWEEP)]


@click.command()
@click.option("--shape", "shapes", multiple=True, type=click.Choice(sorted(SHAPES)), default=("paper", "production"), show_default=True)
@click.option(
    "--sweep",
    is_flag=True,
    help="64 → 4,096 trajectories in flight on the production cluster, 16,384 on production-3k: a table and sweep.png",
)
@click.option("--resume", is_flag=True, help="reuse each point already measured in --out with the same settings (its point.json)")
@click.option(
    "--steps",
    "steps",
    multiple=True,
    type=int,
    default=(6,),
    show_default=True,
    help="with --sweep one per point in order (the last repeats)",
)
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
def main(shapes, sweep, resume, steps, warmup, time_scales, out, overrides):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if sweep:
        scales, counts = (per_point(x) for x in (time_scales, steps))
        results = [
            point(shape, n, warmup, ts, out / f"sweep-{shape}-{g}", list(overrides), batch_groups=g, resume=resume)
            for (shape, g), ts, n in zip(SWEEP, scales, counts)
        ]
        table("in flight 64 → 4,096 on 1,056 GPUs, 16,384 on 3,072 (EMULATED hardware, eager α=1; 2 cores)", results)
        plot(results, out / "sweep.png")
        (out / "sweep.json").write_text(json.dumps(results, indent=2, default=str))
        console.print(f"plot: {(out / 'sweep.png').resolve()}")
        return
    results = [point(shape, steps[0], warmup, time_scales[0], out / shape, list(overrides), resume=resume) for shape in shapes]
    table("the runtime at scale (EMULATED hardware, eager α=1, multi-task workload; 2 cores)", results)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
