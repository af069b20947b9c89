"""Control-plane overhead: the real runtime with a null engine (emulated, time_scale 0: no sleeping)
and a null env (synthetic, no injected latency), at 256 … 4,096 trajectories in flight.

Everything a turn costs here is the control plane's: batches (the calls of one tick to one
service) sent over the channels to their workers, the streamed answers, the client's coroutines. Reports per trajectory count: turns per second, the
median generate and env.step round trip (the per-turn added latency), and where the CPU time
went over the measured steps: the client's process, the scheduler's (its own process on the
embedded cluster) and the worker processes.

    python benchmarks/control_plane.py                      # 256, 1024, 4096 in flight
    python benchmarks/control_plane.py --inflight 64 --inflight 256 --inflight 1024 --inflight 4096 --inflight 16384 --steps 8
                                                            # the CPU-per-turn sweep and its figure (cpu_per_turn.png)
    python benchmarks/control_plane.py --inflight 256 --steps 3
    python benchmarks/control_plane.py --compare            # and the bare transport beside it, alternating
    python benchmarks/control_plane.py --service-bound      # 128 in flight, 50 ms / 10 ms services: added latency per call

``--compare`` measures, in the same process and on the same embedded cluster, a bare coalescing loop:
the same number of trajectories in flight, each making the calls the runtime makes for one — env.reset,
4 turns of generate + env.step, reward: 10 calls per 4 turns —, the calls of one event-loop tick to
one service sent as one Dask task (resource-annotated, gathered) whose answers are nothing — no
runtime at all. It alternates bare and runtime three times per size and prints
runtime / bare. The runtime's pinned calls no longer travel as Dask tasks (they go straight to
their workers), so the ratio may pass 1: the bare loop is the transport the runtime stood on.
"""

from __future__ import annotations

import asyncio
import json
import resource
import statistics
import time
from pathlib import Path

import click

from rollart_dask.models.prepare import prepare_model
from rollart_dask.resource.cluster import connect
from rollart_dask.config import load_flow
from rollart_dask.control.run import Run
from rollart_dask.serve.lambda_local import start_local_endpoint
from rollart_dask.observe import console

FLOW = {
    "name": "control-plane",
    "engine": {"backend": "null"},
    "trainer": {"backend": "emulated"},
    "emulation": {"time_scale": 0.0, "pools": {"H800": {"gpu": "H800", "gpus": 8}, "H20": {"gpu": "H20", "gpus": 8}}},
    "rollout": {"mode": "rollart", "alpha": 1, "admission": "eager", "group_size": 8},
    "eval": {"every": 0},
    "observe": {"tensorboard": False, "progress": False, "watchdog_s": 600},
    "tasks": [
        {
            "name": "null",
            "env": "synthetic",
            "reward": "emulated",
            "max_tokens": 64,
            "env_args": {"turns": 4, "prompt_tokens": 256, "obs_tokens": 32, "output_tokens": 16},
        }
    ],
}


def _cpu_s(dask_worker=None) -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def _scheduler_sent(dask_scheduler=None) -> int:
    """Messages the scheduler has sent so far, to workers and clients (its batched streams count them)."""
    return sum(b.message_count for b in (*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()))


def _client_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# Service-bound: each generate takes 50 ms and each env.step 10 ms (emulated seconds at time scale 0.01: 5 s and 1 s),
# so what a call waits beyond that is what the control plane adds.
SERVICE_BOUND = {"generate_ms": 50.0, "env_step_ms": 10.0, "time_scale": 0.01}


def service_bound_overrides() -> list[str]:
    ts = SERVICE_BOUND["time_scale"]
    step = {"step_latency": {"dist": "constant", "s": SERVICE_BOUND["env_step_ms"] / 1e3 / ts}}
    return [
        f"emulation.time_scale={ts}",
        f"emulation.null_generate_s={SERVICE_BOUND['generate_ms'] / 1e3 / ts}",
        f"tasks.0.inject={json.dumps(step)}",
    ]


async def timed_run(cfg, run_dir: Path) -> dict:
    """One run of ``cfg`` on a fresh embedded cluster, its metrics.jsonl fresh in ``run_dir``: the run, its wall
    seconds, CPU seconds (client, {worker: s}, scheduler) before and after it, and the messages the scheduler sent."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    client, cluster = await connect(cfg.cluster)
    try:
        run = Run(cfg, client, run_dir, prepare_model(cfg), start_endpoint=start_local_endpoint)
        await run.setup()
        cpu0 = (_client_cpu_s(), await client.run(_cpu_s), await client.run_on_scheduler(_cpu_s))
        sent0 = await client.run_on_scheduler(_scheduler_sent)
        t0 = time.monotonic()
        await run.run()
        wall = time.monotonic() - t0
        cpu1 = (_client_cpu_s(), await client.run(_cpu_s), await client.run_on_scheduler(_cpu_s))
        sent = await client.run_on_scheduler(_scheduler_sent) - sent0
        await run.stop()
    finally:
        await client.close()
        await cluster.close()
    return {"run": run, "wall_s": wall, "cpu_before": cpu0, "cpu_after": cpu1, "scheduler_sent": sent}


async def measure(inflight: int, steps: int, out: Path, overrides: list[str] = ()) -> dict:
    # eager α=1 keeps up to 2 batches of groups untrained: in flight ≈ 2 × batch_groups × 8
    cfg = load_flow(
        data=json.loads(json.dumps(FLOW)),
        overrides=[f"rollout.batch_groups={max(1, inflight // 16)}", f"trainer.steps={steps}", *overrides],
    )
    run_dir = out / f"inflight-{inflight}"
    t = await timed_run(cfg, run_dir)
    run, wall, cpu0, cpu1, sent = t["run"], t["wall_s"], t["cpu_before"], t["cpu_after"], t["scheduler_sent"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    st = [r for r in rows if r["kind"] == "step"]
    turns = run.counts["turns"]
    lat = {
        (stage, q): statistics.median(r["stage_latency"][stage][f"{q}_ms"] for r in st if stage in r["stage_latency"])
        for stage in ("generate", "env-step")
        for q in ("p50", "p99")
    }
    workers = sum(cpu1[1].values()) - sum(cpu0[1].values())
    return {
        "inflight": inflight,
        "batch_trajectories": cfg.rollout.batch_groups * 8,
        "steps": len(st),
        "turns": turns,
        "wall_s": wall,
        "turns_per_s": turns / wall,
        "generate_p50_ms": lat["generate", "p50"],
        "env_step_p50_ms": lat["env-step", "p50"],
        "generate_p99_ms": lat["generate", "p99"],
        "env_step_p99_ms": lat["env-step", "p99"],
        "batches_per_turn": run.d.futures / max(turns, 1),
        "calls_per_turn": run.d.calls / max(turns, 1),
        "scheduler_msgs_per_turn": sent / max(turns, 1),
        "cpu_s": {
            "client": cpu1[0] - cpu0[0],
            "scheduler": cpu1[2] - cpu0[2],
            "workers": workers,
            "per_worker": {a: round(cpu1[1][a] - cpu0[1].get(a, 0.0), 2) for a in cpu1[1]},
        },
    }


def null_batch(items: list) -> list:
    """The bare loop's service: answers every item of the batch with nothing."""
    return [None] * len(items)


async def bare_loop(client, inflight: int, seconds: float, turns: int = 4) -> dict:
    """Trajectories of env.reset (CPU), ``turns`` × (generate on H800, env.step on CPU), reward (REWARD) — the
    runtime's calls for one — kept ``inflight`` at a time for ``seconds``; each service's calls of one tick go out
    as one task. Returns turns/s, calls per turn and per-call latency."""
    loop = asyncio.get_running_loop()
    pools = {"env-reset": "CPU", "generate": "H800", "env-step": "CPU", "reward": "REWARD"}
    pending: dict[str, list] = {svc: [] for svc in pools}
    latency: list[float] = []
    done_turns = 0
    stop_at = time.monotonic() + seconds

    def flush(svc: str) -> None:
        futs, pending[svc] = pending[svc], []
        dfut = client.submit(null_batch, [None] * len(futs), resources={pools[svc]: 1}, pure=False)

        async def collect() -> None:
            await dfut
            for f in futs:
                f.set_result(None)

        asyncio.ensure_future(collect())

    async def call(svc: str) -> None:
        fut = loop.create_future()
        bucket = pending[svc]
        bucket.append(fut)
        if len(bucket) == 1:
            loop.call_soon(flush, svc)
        t0 = time.perf_counter()
        await fut
        latency.append(time.perf_counter() - t0)

    async def trajectories() -> None:
        nonlocal done_turns
        while time.monotonic() < stop_at:
            await call("env-reset")
            for _ in range(turns):
                await call("generate")
                await call("env-step")
            await call("reward")
            done_turns += turns

    t0 = time.monotonic()
    await asyncio.gather(*(trajectories() for _ in range(inflight)))
    wall = time.monotonic() - t0
    latency.sort()
    return {
        "turns": done_turns,
        "wall_s": wall,
        "turns_per_s": done_turns / wall,
        "calls_per_turn": len(latency) / max(done_turns, 1),
        "call_p50_ms": 1e3 * latency[len(latency) // 2],
        "call_p99_ms": 1e3 * latency[int(len(latency) * 0.99)],
    }


async def compare(sizes: tuple[int, ...], steps: int, rounds: int, out: Path, overrides: list[str] = ()) -> list[dict]:
    """Bare loop and runtime alternating ``rounds`` times per size, the bare loop on a cluster of the same spec."""
    cfg = load_flow(data=json.loads(json.dumps(FLOW)))
    rows = []
    for n in sizes:
        for r in range(rounds):
            rt = await measure(n, steps, out, overrides)
            client, cluster = await connect(cfg.cluster)
            try:
                bare = await bare_loop(client, n, seconds=max(5.0, rt["wall_s"] / 2))
            finally:
                await client.close()
                await cluster.close()
            row = {
                "inflight": n,
                "round": r + 1,
                "bare_turns_per_s": bare["turns_per_s"],
                "runtime_turns_per_s": rt["turns_per_s"],
                "ratio": rt["turns_per_s"] / bare["turns_per_s"],
                "bare_call_p50_ms": bare["call_p50_ms"],
                "bare_calls_per_turn": bare["calls_per_turn"],
                "runtime_calls_per_turn": rt["calls_per_turn"],
                "bare_call_p99_ms": bare["call_p99_ms"],
                "runtime": rt,
            }
            console.print({k: v for k, v in row.items() if k != "runtime"})
            rows.append(row)
    return rows


PARTS = ("client", "scheduler", "workers")


def _cpu_ms(r: dict) -> dict:
    """CPU milliseconds per turn by process, and all of them together."""
    per = {k: 1e3 * r["cpu_s"][k] / max(r["turns"], 1) for k in PARTS}
    return {**per, "all": sum(per.values())}


def _cpu_ms_per_turn(r: dict) -> str:
    return " / ".join(f"{_cpu_ms(r)[k]:.2f}" for k in PARTS)


def plot_cpu_per_turn(results: list[dict], path: Path) -> None:
    """CPU ms per turn against trajectories in flight, by process and in all (the sweep's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["inflight"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for part in (*PARTS, "all"):
        ax.plot(xs, [_cpu_ms(r)[part] for r in results], marker="o", label=part, linewidth=2.5 if part == "all" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("trajectories in flight")
    ax.set_ylabel("CPU ms per turn")
    ax.set_ylim(bottom=0)
    ax.set_title("control plane: CPU per turn (null engine, null env; 2 cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command()
@click.option("--inflight", multiple=True, type=int, default=(256, 1024, 4096), show_default=True, help="trajectories in flight")
@click.option("--steps", default=4, show_default=True)
@click.option("--out", default="runs/bench-control-plane", show_default=True)
@click.option("--compare", "compare_", is_flag=True, help="alternate the bare coalescing loop and the runtime, three rounds per size")
@click.option("--rounds", default=3, show_default=True, help="with --compare: rounds per size")
@click.option("--service-bound", is_flag=True, help="128 in flight with 50 ms generate and 10 ms env.step: the latency each call adds")
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="flow override for the runtime's runs (e.g. rollout.coalesce_inflight=1)"
)
def main(inflight, steps, out, compare_, rounds, service_bound, overrides):
    from rich.table import Table

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if service_bound:
        r = asyncio.run(measure(128, steps, out, [*service_bound_overrides(), *overrides]))
        added = {
            "generate": (r["generate_p50_ms"] - SERVICE_BOUND["generate_ms"], r["generate_p99_ms"] - SERVICE_BOUND["generate_ms"]),
            "env.step": (r["env_step_p50_ms"] - SERVICE_BOUND["env_step_ms"], r["env_step_p99_ms"] - SERVICE_BOUND["env_step_ms"]),
        }
        table = Table(title="service-bound: 128 in flight, 50 ms generate (null engine), 10 ms env.step (injected); 2 cores")
        for col in ("call", "service ms", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms"):
            table.add_column(col)
        for call, svc, key in (
            ("generate", SERVICE_BOUND["generate_ms"], "generate"),
            ("env.step", SERVICE_BOUND["env_step_ms"], "env_step"),
        ):
            table.add_row(
                call,
                f"{svc:.0f}",
                f"{r[key + '_p50_ms']:.1f}",
                f"{r[key + '_p99_ms']:.1f}",
                f"{added[call][0]:.1f}",
                f"{added[call][1]:.1f}",
            )
        console.print(table)
        (out / "service_bound.json").write_text(json.dumps({**r, "added_ms": added, "service": SERVICE_BOUND}, indent=2))
        return
    if compare_:
        rows = asyncio.run(compare(tuple(inflight), steps, rounds, out, list(overrides)))
        table = Table(title="runtime vs bare coalescing loop (null services, 4 turns per trajectory; same cluster spec, 2 cores)")
        for col in (
            "in flight",
            "round",
            "bare turns/s",
            "runtime turns/s",
            "runtime / bare",
            "calls per turn: bare / runtime",
            "bare call p50 / p99 ms",
            "runtime generate / env.step p50 / p99 ms",
            "runtime CPU ms per turn: client / scheduler / workers",
            "batches per turn",
            "scheduler messages sent per turn",
        ):
            table.add_column(col)
        for r in rows:
            rt = r["runtime"]
            table.add_row(
                str(r["inflight"]),
                str(r["round"]),
                f"{r['bare_turns_per_s']:.0f}",
                f"{r['runtime_turns_per_s']:.0f}",
                f"{r['ratio']:.2f}",
                f"{r['bare_calls_per_turn']:.2f} / {r['runtime_calls_per_turn']:.2f}",
                f"{r['bare_call_p50_ms']:.1f} / {r['bare_call_p99_ms']:.1f}",
                f"{rt['generate_p50_ms']:.1f} / {rt['env_step_p50_ms']:.1f} / {rt['generate_p99_ms']:.0f} / {rt['env_step_p99_ms']:.0f}",
                _cpu_ms_per_turn(rt),
                f"{rt['batches_per_turn']:.3f}",
                f"{rt['scheduler_msgs_per_turn']:.3f}",
            )
        console.print(table)
        (out / "compare.json").write_text(json.dumps(rows, indent=2))
        return
    results = []
    for n in inflight:
        console.print(f"[bold]{n} trajectories in flight[/bold] (null engine, null env, 4 turns each)")
        results.append(asyncio.run(measure(n, steps, out, list(overrides))))
        console.print(results[-1])
    table = Table(title="control-plane overhead (null engine, null env; 2 cores)")
    for col in (
        "in flight",
        "turns/s",
        "generate p50 (ms)",
        "env.step p50 (ms)",
        "CPU ms per turn: client / scheduler / workers",
        "CPU ms per turn, all",
        f"÷ at {results[0]['inflight']}",
        "batches per turn",
        "scheduler messages sent per turn",
        "wall s",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            str(r["inflight"]),
            f"{r['turns_per_s']:.0f}",
            f"{r['generate_p50_ms']:.1f}",
            f"{r['env_step_p50_ms']:.1f}",
            _cpu_ms_per_turn(r),
            f"{_cpu_ms(r)['all']:.2f}",
            f"{_cpu_ms(r)['all'] / _cpu_ms(results[0])['all']:.2f}",
            f"{r['batches_per_turn']:.3f}",
            f"{r['scheduler_msgs_per_turn']:.3f}",
            f"{r['wall_s']:.1f}",
        )
    console.print(table)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if len(results) > 1:
        plot_cpu_per_turn(results, out / "cpu_per_turn.png")
        console.print(f"figure: {out / 'cpu_per_turn.png'}")


if __name__ == "__main__":
    main()
