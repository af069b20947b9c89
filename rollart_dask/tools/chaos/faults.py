"""Faults fired into a live run on the embedded default (the chaos suite; never part of a normal run).

The injector watches the run from its own coroutine and fires each fault of its scenario when its moment
comes (scenarios.py). Worker faults are what the scheduler would see of a machine: a worker process that
dies at once (``os._exit``), which its Nanny restarts, or for good (the Nanny is told to stand down first).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import time
from pathlib import Path

from rollart_dask import compat
from rollart_dask.config import ClusterConfig, WorkerSpec
from rollart_dask.resource.cluster import cluster_spec
from rollart_dask.tools.chaos.scenarios import TRAINER, Fault, Scenario


async def _exit_now(dask_worker=None) -> None:  # runs on the worker: dies as a crashed machine would, mid-work
    os._exit(1)


def _disk_full(full: bool, dask_worker=None) -> None:
    """EMULATED: the trainer's checkpoint writes run out of space (a first file written, then ENOSPC), or no longer."""
    from rollart_dask.data.plugins import TRAINER

    trainer = dask_worker.plugins[TRAINER].service
    if not full:
        trainer.__dict__.pop("save_checkpoint", None)
        return

    def out_of_space(path):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / "model.safetensors"))

    trainer.save_checkpoint = out_of_space


class Injector:
    def __init__(self, scenario: Scenario, seed: int = 0):
        self.scenario, self.rng = scenario, random.Random(seed)
        # [fault, its delay once its moment comes, when that moment came (None: not yet)]
        self.pending = [[f, f.delay_s if f.delay_s is not None else self.rng.uniform(0.1, 0.6), None] for f in scenario.faults]
        self.fired: list[dict] = []
        self.errors: list[str] = []
        self.run = None
        self._task: asyncio.Task | None = None
        self._later: set[asyncio.Task] = set()  # faults fired a delay into their moment

    def attach(self, run) -> None:
        """``on_ready`` of run_flow: watch this run. A fault for mid-Train fires as the Train is submitted, one for
        mid-update as the engines are told to swap (the run's own calls, wrapped): no poll could catch a short one."""
        self.run = run
        self._task = asyncio.ensure_future(self._watch())
        for moment, owner, method in (("train", run, "train"), ("update", run.services.proxy, "update_weights")):
            if any(f.moment == moment for f, _, _ in self.pending):
                setattr(owner, method, self._hooked(moment, getattr(owner, method)))

    def _hooked(self, moment: str, call):
        async def hooked(*args, **kwargs):
            out = None
            if moment == "train":  # the Train is in flight once submitted: fire after
                out = await call(*args, **kwargs)
            for entry in [e for e in self.pending if e[0].moment == moment and self._steps() >= e[0].after_step]:
                self.pending.remove(entry)
                if entry[0].delay_s:  # this long into the Train (or the swap): fired while the run goes on
                    self._later.add(asyncio.ensure_future(self._fire(entry[0], self._steps(), entry[0].delay_s)))
                else:
                    await self._fire(entry[0], self._steps())
            return out if moment == "train" else await call(*args, **kwargs)

        return hooked

    def _steps(self) -> int:
        return self.run.published - self.run.launcher.base_version

    async def _watch(self) -> None:
        run = self.run
        while self.pending and not run.launcher.stopping:
            await asyncio.sleep(0.02)
            for entry in [e for e in self.pending if e[0].moment == "rollout"]:
                fault, delay, due = entry
                if due is None and self._steps() >= fault.after_step:
                    entry[2] = due = time.monotonic()
                if due is not None and time.monotonic() - due >= delay:
                    self.pending.remove(entry)
                    await self._fire(fault, self._steps())

    async def _fire(self, fault: Fault, steps: int, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        t0 = time.monotonic()
        try:
            await getattr(self, fault.action)(fault.target)
        except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, never hidden
            self.errors.append(f"{fault.describe()}: {type(e).__name__}: {e}")
        self.fired.append({"fault": fault, "what": fault.describe(), "at_step": steps, "at_s": round(t0 - self.run.status.t_start, 2)})

    async def stop(self) -> None:
        for task in [self._task, *self._later]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._later] if t is not None), return_exceptions=True)

    # -- actions ------------------------------------------------------------------------------------
    async def _address(self, name: str) -> str:
        if name == TRAINER:  # whichever worker holds it now
            return self.run.services.trainer
        info = (await self.run.client.scheduler.identity())["workers"]
        found = [a for a, w in info.items() if w.get("name") == name]
        if not found:
            raise LookupError(f"no worker named {name} (workers: {sorted(w.get('name') for w in info.values())})")
        return found[0]

    async def restart_worker(self, name: str) -> None:
        await self.run.client.run(_exit_now, workers=[await self._address(name)], wait=False)

    async def lose_worker(self, name: str) -> None:
        address = await self._address(name)
        cluster = self.run.cluster
        if cluster is None:
            raise RuntimeError("lose_worker needs the embedded cluster (its Nanny must stand down)")
        nanny = compat.nanny_of(address)
        if nanny is None:
            raise LookupError(f"no Nanny of {name} in this process")
        compat.stand_down(nanny)
        cluster.worker_spec.pop(self.run.services.poolmap.name(address), None)
        await self.run.client.run(_exit_now, workers=[address], wait=False)

    async def fill_disk(self, name: str) -> None:
        await self.run.client.run(_disk_full, True, workers=[await self._address(name)])

    async def free_disk(self, name: str) -> None:
        await self.run.client.run(_disk_full, False, workers=[await self._address(name)])

    async def add_worker(self, target: str) -> None:
        name, pools = target.split(":", 1)
        cluster = self.run.cluster
        spec = cluster_spec(
            ClusterConfig(listen=self.run.cfg.cluster.listen, workers=[WorkerSpec(name=name, pools=pools.split(","), nthreads=2)]),
            cluster.security,
        )
        cluster.worker_spec[name] = spec["workers"][name]
        await compat.correct_state(cluster)

    async def drop_scheduler(self, _: str = "") -> None:
        """The client's connection to the scheduler cut, as a network blip would; the client dials again by itself."""
        await compat.cut_scheduler_connection(self.run.client)

    async def kill_mooncake_master(self, _: str = "") -> None:
        await asyncio.to_thread(self._master().kill_master)

    async def restart_mooncake_master(self, _: str = "") -> None:
        await asyncio.to_thread(self._master().restart_master)

    def _master(self):
        master = self.run.services.weights.master
        if master is None:
            raise RuntimeError("no local mooncake_master in this run (weights.store=mooncake on the embedded default starts one)")
        return master

    async def kill_endpoint(self, _: str = "") -> None:
        await asyncio.to_thread(self._endpoint().kill)

    async def restart_endpoint(self, _: str = "") -> None:
        await asyncio.to_thread(self._endpoint().restart)

    def _endpoint(self):
        endpoint = self.run.services.rewards.endpoint
        if endpoint is None or endpoint.process is None:
            raise RuntimeError("no local reward endpoint process in this run (reward.mode=serverless starts one)")
        return endpoint.process
