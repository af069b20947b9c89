"""Engines that leave and join a running run (control/membership.py is told they come and go).

A lost engine stops taking calls; its requests fail over (their trajectories are relaunched) and a transfer
to it is not waited for. A worker that joins one of the run's engine pools — its Nanny's restart of a lost
one, or a new worker — gets the run's engine from the plugin, and this brings it to the engines' version
before it takes a call: the installed version is staged from the weights the store keeps for it and
swapped in, and a newer version being pulled is staged too (the next Update waits), so that Update swaps it
with the others.
Admission and Update take turns (``Elasticity.weights_turn``): an engine never swaps back behind an Update.
"""

from __future__ import annotations

import asyncio
import time

from rollart_dask.observe import console


def _engine_ready(dask_worker=None) -> bool:
    plugin = dask_worker.plugins.get("rollart-engine")
    return plugin is not None and plugin.service is not None


class Elasticity:
    """Engines lost and joined, given the run's status (its version and counters) and, once set up, its services."""

    def __init__(self, cfg, status):
        self.cfg, self.status = cfg, status
        self.services = None  # (attach: wired at set-up, after this is made)
        self.weights_turn = asyncio.Lock()  # Update and a joining engine's catch-up take turns
        self.joining: set[asyncio.Task] = set()  # engines being brought to the engines' version

    def attach(self, services) -> None:
        """A control call (Update, abort, reset) that fails on an engine which is dying ends before the membership
        watch has seen the loss: the proxy asks here, and a departed engine is lost, not the run's failure."""
        self.services = services
        services.proxy.on_engine_error = self._gone

    async def _gone(self, address: str, error: Exception) -> bool:
        for _ in range(20):  # the scheduler hears of a dead worker's closed comms within moments
            if address not in (await self.services.client.scheduler.identity())["workers"]:
                self.engine_lost(address)
                return True
            await asyncio.sleep(0.25)
        return False

    def engine_lost(self, address: str) -> None:
        s = self.services
        if s.proxy.engine_lost(address):
            s.weights.engine_lost(address)
            self.status.counts["engines_lost"] += 1

    def engine_joined(self, address: str, pool: str) -> None:
        self.joining.add(asyncio.ensure_future(self._admit(address, pool)))

    async def _admit(self, address: str, pool: str) -> None:
        """Bring a joined engine to the engines' version, then route calls to it. A failure is counted and said;
        the run goes on with the engines it has."""
        s, counts, t0 = self.services, self.status.counts, time.monotonic()
        wait_s = self.cfg.rollout.worker_wait_s
        try:
            deadline = t0 + wait_s
            while not (await s.client.run(_engine_ready, workers=[address])).get(address):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"its engine did not start within rollout.worker_wait_s={wait_s:.0f} s")
                await asyncio.sleep(0.5)
            async with self.weights_turn:  # (bounded: an Update waits for this lock)
                s.proxy.engine_joining(address, pool)  # a version published from now on is staged here too
                installed = s.proxy.version
                pools = list(s.proxy.pool_of.values())
                # a stage pinned to an engine that dies while it joins would never end: engine_lost cancels it
                await asyncio.wait_for(s.weights.stage_on(address, pool, installed, pools), wait_s)
                await s.proxy.swap_one(address, pool, installed)
                if self.status.published > installed:  # being pulled by the others: staged here too before the next Update
                    await asyncio.wait_for(s.weights.stage_on(address, pool, self.status.published, pools), wait_s)
                s.weights.lost.discard(address)
                s.proxy.engine_serving(address, pool)
            counts["engines_joined"] += 1
            console.print(f"engine {s.poolmap.name(address)} ({pool}) joined at v{installed} in {time.monotonic() - t0:.1f} s")
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - said and counted; the run goes on without it
            if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the run stops (its stage, cancelled by engine_lost, is not)
            self.engine_lost(address)
            counts["engine_join_failed"] += 1
            console.print(f"[yellow]engine {s.poolmap.name(address)} ({pool}) could not join: {type(e).__name__}: {e}[/yellow]")
