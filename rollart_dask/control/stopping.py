"""How a run (control/run.py, passed in) ends: the summary of a run that reached its end, and how it ends before its last step, never by hanging: the wall-clock deadline (trainer.max_minutes, honoured even
when no step completes), a background task of the run that dies (it stops the run, named), and what a run that
stopped on an error still writes (its summary; after a user fault, the trainer's weights too)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

from rollart_dask.control.breaker import UserFault
from rollart_dask.control.telemetry import pd_metrics
from rollart_dask.observe import console


def background(run, coros: dict) -> list[asyncio.Task]:
    """The run's background tasks (name → coroutine), the deadline among them; one that dies fails the run."""
    if run.cfg.trainer.max_minutes:
        coros = {**coros, "deadline": deadline(run, run.cfg.trainer.max_minutes)}
    tasks = [asyncio.ensure_future(c) for c in coros.values()]
    for name, task in zip(coros, tasks):
        task.add_done_callback(lambda task, name=name: _ended(run, name, task))
    return tasks


async def deadline(run, minutes: float) -> None:
    await asyncio.sleep(max(0.0, minutes * 60 - (time.monotonic() - run.status.t_start)))
    run.stop_reason = f"time limit of {minutes:g} min (trainer.max_minutes) reached"
    run.request_stop()


def _ended(run, name: str, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None and not run.stopped:
        e = task.exception()
        run.status.fail(RuntimeError(f"the run's {name} task died: {type(e).__name__}: {e}"))


def ended(run) -> dict:
    """The summary of a run that reached its end: first and last held-out evaluations, its final checkpoint, the counts."""
    s = run.services
    return {
        "first": run.history[0],
        "last": run.history[-1],
        "checkpoint": run.final_checkpoint,
        "checkpoint_sha256": weights_digest(run.final_checkpoint),
        "elapsed_s": time.monotonic() - run.status.t_start,
        "counts": {**run.buffer.counts, **run.counts, **s.em.counts, **s.weights.counts},
        "steps": run.published - run.launcher.base_version,
        "weights": s.weights.summary(),
        "rollout_tokens": run.telemetry.tokens(),
        "generate_pools": s.proxy.landed_by_task(),
        "accounting": run.accounting(),
        **({"pd": pd_metrics(run.telemetry.engine_stats)} if run.cfg.rollout.pd else {}),  # totals at the last step
        **({"placement": run.placement.summary()} if run.placement else {}),
    }


def weights_digest(checkpoint: str | None) -> str | None:
    """sha256 of a checkpoint's weight files (*.safetensors, by name): equal for runs that trained the same weights bit for
    bit. None without a checkpoint, or when it is not on this machine's disk (an attached cluster's)."""
    files = sorted(Path(checkpoint).glob("*.safetensors")) if checkpoint else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


async def stopped_with(run, error: Exception) -> dict:
    """The summary of a run that stopped on ``error``. A user fault leaves the trainer sound: its weights are saved
    (checked finite on the way); otherwise the last good checkpoint stands."""
    checkpoint = run.recovery.base
    if isinstance(error, UserFault):
        await run.launcher.stop()  # no more trajectories to fail meanwhile
        run.status.fatal = None  # (the trainer's calls below would raise it again)
        run.status.failing.clear()
        try:
            await asyncio.wait_for(run.finish_training(), 120)
            checkpoint = await asyncio.wait_for(run.checkpoint(), 120) or checkpoint
        except Exception as e:
            console.print(f"no checkpoint at the stop ({type(e).__name__}: {e}); the last good one: {checkpoint}", markup=False)
    return {
        "error": str(error),
        "stopped_by": type(error).__name__,
        "checkpoint": checkpoint,
        "steps": run.published - (run.launcher.base_version if run.launcher else 0),
        "elapsed_s": time.monotonic() - run.status.t_start,
        "first": run.history[0] if run.history else None,
        "last": run.history[-1] if run.history else None,
        "counts": {**run.buffer.counts, **run.counts, **(run.services.em.counts if run.services else {})},
    }
