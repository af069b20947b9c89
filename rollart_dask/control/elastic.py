"""Engines that leave and join a running run (control/membership.py is told they come and go).

A lost engine stops taking calls; its requests fail over (their trajectories are relaunched) and a transfer
to it is not waited for. A worker that joins one of the run's engine pools — its Nanny's restart of a lost
one, or a new worker — gets the run's engine from the plugin, and this brings it to the engines' version
before it takes a call: the installed version is staged from the weights the store keeps for it and
swapped in, and a newer version being pulled is staged too (the next Update waits), so that Update swaps it
with the others.
Admission and Update take turns (``Run.weights_turn``): an engine never swaps back behind an Update.
"""

from __future__ import annotations

import asyncio
import time

from rollart_dask.observe import console


def _engine_ready(dask_worker=None) -> bool:
    plugin = dask_worker.plugins.get("rollart-engine")
    return plugin is not None and plugin.service is not None


def engine_lost(run, address: str) -> None:
    s = run.services
    if s.proxy.engine_lost(address):
        s.weights.engine_lost(address)
        run.counts["engines_lost"] += 1


def watch(run) -> None:
    """A control call (Update, abort, reset) that fails on an engine which is dying ends before the monitor has seen
    the loss: ask the scheduler, and a departed engine is lost, not the run's failure."""

    async def gone(address: str, error: Exception) -> bool:
        for _ in range(20):  # the scheduler hears of a dead worker's closed comms within moments
            if address not in (await run.client.scheduler.identity())["workers"]:
                engine_lost(run, address)
                return True
            await asyncio.sleep(0.25)
        return False

    run.services.proxy.on_engine_error = gone


async def admit_engine(run, address: str, pool: str) -> None:
    """Bring a joined engine to the engines' version, then route calls to it. A failure is counted and said;
    the run goes on with the engines it has."""
    s, t0 = run.services, time.monotonic()
    try:
        deadline = t0 + run.cfg.rollout.worker_wait_s
        while not (await s.client.run(_engine_ready, workers=[address])).get(address):
            if time.monotonic() > deadline:
                raise TimeoutError(f"its engine did not start within rollout.worker_wait_s={run.cfg.rollout.worker_wait_s:.0f} s")
            await asyncio.sleep(0.5)
        async with run.weights_turn:  # (bounded: an Update waits for this lock)
            s.proxy.engine_joining(address, pool)  # a version published from now on is staged here too
            installed = s.proxy.version
            pools = list(s.proxy.pool_of.values())
            wait_s = run.cfg.rollout.worker_wait_s
            # a stage pinned to an engine that dies while it joins would never end: engine_lost cancels it
            await asyncio.wait_for(s.weights.stage_on(address, pool, installed, pools), wait_s)
            await s.proxy.swap_one(address, pool, installed)
            if run.published > installed:  # being pulled by the others: staged here too before the next Update (which waits)
                await asyncio.wait_for(s.weights.stage_on(address, pool, run.published, pools), wait_s)
            s.weights.lost.discard(address)
            s.proxy.engine_serving(address, pool)
        run.counts["engines_joined"] += 1
        console.print(f"engine {s.poolmap.name(address)} ({pool}) joined at v{installed} in {time.monotonic() - t0:.1f} s")
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - said and counted; the run goes on without it
        if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise  # the run stops (its stage, cancelled by engine_lost, is not)
        engine_lost(run, address)
        run.counts["engine_join_failed"] += 1
        console.print(f"[yellow]engine {s.poolmap.name(address)} ({pool}) could not join: {type(e).__name__}: {e}[/yellow]")
