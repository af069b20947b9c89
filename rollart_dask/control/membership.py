"""Workers joining and leaving the cluster, told by the scheduler's own events, not found by polling it.

The scheduler logs ``add-worker`` and ``remove-worker`` on its ``all`` event topic; the run subscribes to it
(``Client.subscribe_topic``) for its whole length. A worker that leaves fails its calls over (a lost trainer is
re-created, a lost engine stops taking calls); an env worker that joins gets envs, an engine worker is brought to the
engines' version (control/elastic.py). A subscription lives on one scheduler connection: when the client has a new
one (it reconnected), the run subscribes again and compares the workers it knows with the scheduler's, once.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from rollart_dask import compat
from rollart_dask.observe import console
from rollart_dask.resource.pools import PoolMap

TOPIC = "all"  # the scheduler's topic for cluster-wide events (distributed.Scheduler.add_worker / remove_worker)
ACTIONS = ("add-worker", "remove-worker")


async def watch(services, status, recovery, elasticity, stopping: Callable[[], bool]) -> None:
    """The run's background task: apply every join and departure until ``stopping()``. Given what a change is told to
    (the run's status, its trainer recovery and elasticity), not the run."""
    await Membership(services, status, recovery, elasticity).watch(stopping)


class Membership:
    def __init__(self, services, status, recovery, elasticity):
        self.services, self.status, self.recovery, self.elasticity = services, status, recovery, elasticity

    async def watch(self, stopping: Callable[[], bool]) -> None:
        s, recovery = self.services, self.recovery
        events: asyncio.Queue = asyncio.Queue()

        def on_event(event) -> None:
            _, msg = event
            if isinstance(msg, dict) and msg.get("action") in ACTIONS and msg.get("worker"):
                events.put_nowait(msg)

        known = set(s.poolmap.workers)
        subscribed_on = None
        try:
            while not stopping():
                comm, seen = compat.scheduler_connection(s.client), recovery.seen_comm
                if seen is not None and comm is not seen:  # a new connection to the scheduler: the old one's futures are gone
                    recovery.connection_lost()
                recovery.seen_comm = comm
                if comm is not None and comm is not subscribed_on and s.client.status == "running":
                    s.client.subscribe_topic(TOPIC, on_event)
                    subscribed_on = comm
                    known = await self._compare(known)  # what changed before the subscription (or while disconnected)
                try:
                    msg = await asyncio.wait_for(events.get(), 1.0)  # (the timeout: to notice a new connection)
                except asyncio.TimeoutError:
                    continue
                address = msg["worker"]
                if msg["action"] == "remove-worker" and address in known:
                    known.discard(address)
                    self._left(address)
                elif msg["action"] == "add-worker" and address not in known:
                    known = await self._compare(known)  # its pools: one look at the scheduler, for this event
        finally:
            if s.client.status == "running":
                s.client.unsubscribe_topic(TOPIC)

    async def _compare(self, known: set[str]) -> set[str]:
        """Bring the run's view to the scheduler's workers (one identity call); returns the addresses now known."""
        try:
            info = await asyncio.wait_for(self.services.client.scheduler.identity(), 10)
        except Exception:  # the scheduler is away: the next connection compares again
            return known
        current = PoolMap.from_scheduler_info(info)
        for address in known - set(current.workers):
            self._left(address)
        for address in set(current.workers) - known:
            self._joined(address, current.workers[address])
        return set(current.workers)

    def _left(self, address: str) -> None:
        s = self.services
        lost = s.d.worker_lost(address)
        s.em.worker_lost(address)
        self.elasticity.engine_lost(address)
        self.status.counts["workers_lost"] += 1
        console.print(f"[yellow]worker {s.poolmap.name(address)} left the cluster ({lost} calls failed over)[/yellow]")
        if address == s.trainer:  # re-created on a TRAIN worker, restored and replayed (control/recovery.py)
            self.recovery.trainer_lost(address)

    def _joined(self, address: str, worker: dict) -> None:
        s = self.services
        s.poolmap.workers[address] = worker
        resources = worker["resources"]
        if "CPU" in resources:
            s.em.worker_joined(address)
        s.em.reward_worker_joined(address, resources)
        pool = next((p for p in s.layout if p in resources), None)
        if pool is not None and not {"TRAIN", "REWARD"} & set(resources):  # (where the engine plugin puts an engine)
            self.elasticity.engine_joined(address, pool)
