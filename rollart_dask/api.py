"""Programmatic entry point: run a flow (embedded cluster or an existing scheduler)."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import yaml

from .config import FlowConfig
from .observe import console


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart-dask"))


def prepare_model(cfg: FlowConfig) -> Path:
    if cfg.emulated:  # EMULATED engines and trainer have no weights: their model is a timing profile
        return Path(f"emulated:{cfg.emulation.model}")
    if cfg.model.kind == "path":
        path = Path(cfg.model.path)  # type: ignore[arg-type]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
        return path
    from .models.tiny import build_tiny_model

    m = cfg.model
    return build_tiny_model(cache_dir() / "models", m.hidden_size, m.layers, m.heads, m.intermediate_size, m.seed)


def write_effective(cfg: FlowConfig, out: Path, extra: dict) -> None:
    data = cfg.model_dump(mode="json")
    data["_effective"] = extra
    (out / "flow.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


async def run_flow(cfg: FlowConfig, out: Path, resume: bool = False, on_step=None, on_ready=None) -> dict:
    """Run a flow to its end. ``on_ready(run)`` is called once set-up is done (before the first
    evaluation); ``on_step(run)`` after every evaluation and training step."""
    from .cluster import connect
    from .loop import Run

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model_dir = prepare_model(cfg)
    client, cluster = await connect(cfg.cluster)
    run = None
    try:
        console.print(f"dashboard: {client.dashboard_link}")
        run = Run(cfg, client, out, model_dir, resume=resume)
        await run.setup()
        if run.dashboard_url:
            console.print(f"rollart page: {run.dashboard_url}")
        console.print(f"engine backend: {run.engine_backend} (asked: {cfg.engine.backend})")
        emulated = {t.name: "env latency/failure injection" for t in cfg.tasks if t.inject}
        if emulated:
            console.print(f"[bold yellow]EMULATED[/bold yellow] env latency/failure injection on tasks: {', '.join(emulated)}")
        if cfg.emulated:
            e = cfg.emulation
            pools = ", ".join(f"{p}: {s.gpus}x{s.gpu} tp{s.tp}/worker" for p, s in e.pools.items() if p in run.layout)
            emulated["hardware"] = f"{e.model} on {pools}; trainer {e.trainer.gpus}x{e.trainer.gpu}; time_scale {e.time_scale}"
            console.print(f"[bold yellow]EMULATED[/bold yellow] hardware timing (no model runs): {emulated['hardware']}")
        write_effective(cfg, out, {"model_dir": str(model_dir), "engine_backend": run.engine_backend, "engines": run.layout,
                                   "scheduler": client.scheduler.address, "emulated": emulated, "rewards": run.rewards.where})
        if on_ready is not None:
            on_ready(run)
        result = await run.run(on_step=on_step)
        result["wall_s"] = time.monotonic() - t0
        return result
    finally:
        if run is not None and run.weights is not None:  # set-up may have failed after starting a local mooncake_master
            await run.weights.close()
        await client.close()
        if cluster is not None:
            await cluster.close()


def run_sync(cfg: FlowConfig, out: Path, resume: bool = False, on_step=None) -> dict:
    return asyncio.run(run_flow(cfg, out, resume=resume, on_step=on_step))
