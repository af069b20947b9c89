"""Programmatic entry point: run a flow (embedded cluster or an existing scheduler)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import yaml

from rollart_dask.config import FlowConfig, task_pools
from rollart_dask.models.prepare import prepare_model
from rollart_dask.models.prompts import check_prompts
from rollart_dask.observe import console
from rollart_dask.serve import dashboard
from rollart_dask.serve.lambda_local import start_local_endpoint


def write_effective(cfg: FlowConfig, out: Path, extra: dict) -> None:
    data = cfg.model_dump(mode="json")
    data["_effective"] = extra
    (out / "flow.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


async def run_flow(cfg: FlowConfig, out: Path, resume: bool = False, on_step=None, on_ready=None, security=None, on_stopped=None) -> dict:
    """Run a flow to its end. ``on_ready(run)`` is called once set-up is done (before the first
    evaluation); ``on_step(run)`` after every evaluation and training step; ``await on_stopped(run)`` once
    the run has stopped, before its cluster closes (also after a failure). ``security``: a distributed
    Security for ``cluster.scheduler`` (else the flow's ``cluster.security``). ``run.cluster`` is the
    embedded cluster (None when attached)."""
    t0 = time.monotonic()
    async with started(cfg, out, resume, security, on_stopped) as run:
        if on_ready is not None:
            on_ready(run)
        result = await run.run(on_step=on_step)
        result["wall_s"] = time.monotonic() - t0
        return result


@contextlib.asynccontextmanager
async def started(cfg: FlowConfig, out: Path, resume: bool | Path = False, security=None, on_stopped=None):
    """A run set up on its cluster (embedded, or the flow's scheduler), its weights installed: from the model, a warm
    start, the latest checkpoint in ``out`` (``resume`` True) or the checkpoint ``resume`` names. Stopped on leaving."""
    from rollart_dask.resource.cluster import cluster_state, connect, leave_as_found
    from rollart_dask.resource.security import MOONCAKE_TRANSPORT, describe
    from rollart_dask.control.run import Run

    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(cfg)
    if not cfg.emulated and cfg.engine.backend != "null":  # (no model runs there)
        check_prompts(cfg, model_dir)
    client, cluster = await connect(cfg.cluster, security)
    run = None
    found = await cluster_state(client) if cluster is None else None  # an attached cluster is left as it was found
    try:
        for line in describe(cfg.cluster, client.scheduler.address, client.dashboard_link):
            console.print(line)
        if cfg.weights.store == "mooncake":
            console.print(MOONCAKE_TRANSPORT)
        # the embedded default's serverless rewards go to a local Lambda endpoint started for the run
        run = Run(cfg, client, out, model_dir, resume=resume, start_endpoint=start_local_endpoint)
        run.cluster = cluster
        run.dashboard_url, why = await dashboard.register(client)
        if why:
            console.print(f"[yellow]no RollArt dashboard page: {why} (it needs rollart_dask and bokeh where the scheduler runs)[/yellow]")
        await run.setup()
        s = run.services
        if run.dashboard_url:
            console.print(f"rollart page: {run.dashboard_url}")
        console.print(f"engine backend: {s.engine_backend} (asked: {cfg.engine.backend})")
        if cfg.rollout.deterministic:
            _say_deterministic(cfg)
        if cfg.rollout.pd_route is None:  # (disaggregated, every call is prefilled on one pool and decoded on the other)
            for t in cfg.tasks:
                where = (
                    f"any engine pool for the first {cfg.placement.profile_steps} step(s), then as its measured profile decides"
                    if t.affinity == "auto" and t.name not in s.em.placed
                    else " or ".join(task_pools(t, s.em.placed))
                )
                console.print(f"task {t.name}: affinity {t.affinity} ({t._affinity_from}) → generation on {where}")
        emulated = {t.name: "env latency/failure injection" for t in cfg.tasks if t.inject}
        if cfg.reward.endpoint_faults:
            emulated["reward endpoint"] = f"faults {cfg.reward.endpoint_faults.model_dump()}"
        if emulated:
            console.print(f"[bold yellow]EMULATED[/bold yellow] fault injection: {emulated}")
        if cfg.emulated:
            e = cfg.emulation
            pools = ", ".join(f"{p}: {ep.gpus}x{ep.gpu} tp{ep.tp}/worker" for p, ep in e.pools.items() if p in s.layout)
            emulated["hardware"] = f"{e.model} on {pools}; trainer {e.trainer.gpus}x{e.trainer.gpu}; time_scale {e.time_scale}"
            console.print(f"[bold yellow]EMULATED[/bold yellow] hardware timing (no model runs): {emulated['hardware']}")
        write_effective(
            cfg,
            out,
            {
                "model_dir": str(model_dir),
                "engine_backend": s.engine_backend,
                "engines": s.layout,
                "scheduler": client.scheduler.address,
                "emulated": emulated,
                "rewards": s.rewards.where,
            },
        )
        yield run
    finally:
        if run is not None:  # set-up may have failed after starting a local mooncake_master or reward endpoint
            await run.stop()
            if on_stopped is not None:
                await on_stopped(run)
        if found is not None:
            await leave_as_found(client, found)
        await client.close()
        if cluster is not None:
            await cluster.close()


def run_sync(cfg: FlowConfig, out: Path, resume: bool = False, on_step=None) -> dict:
    """The run in its own event loop. SIGTERM (`kill`, a job scheduler's stop) cancels it as Ctrl-C does, so it stops
    the same way: the run stopped, its embedded cluster closed. Either raises KeyboardInterrupt here."""

    async def main():
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # (no signal handlers off the main thread, or on Windows)
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await run_flow(cfg, out, resume=resume, on_step=on_step)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        raise KeyboardInterrupt("stopped by SIGTERM") from None


def _say_deterministic(cfg) -> None:
    """What rollout.deterministic changes in how the run goes (the flow as written records it too: level, max_batch)."""
    r, minutes = cfg.rollout, cfg.trainer.max_minutes
    console.print(
        f"rollout.deterministic: generation batch by batch (level {r.level}, alpha {r.alpha}), each batch by one version, "
        "taken in launch order; engine requests forwarded one at a time (engine.max_batch 1), tokens from seeded generators"
    )
    if minutes:
        console.print(
            f"[yellow]trainer.max_minutes={minutes:g}: the steps replay alike, but the step a time limit stops at depends on speed[/yellow]"
        )
