"""A trainer re-created when its worker is lost (control/membership.py is told it goes).

Dask cannot recompute a trainer: its state is the sum of every step trained. So the run keeps, in the
client, every trainer call since the last checkpoint (the warm start, each step's batch) with the version
it left the trainer at. When the trainer's worker leaves, a TRAIN worker that has (its Nanny's restart, or
another one) gets a fresh trainer from the plugin; it restores the last checkpoint (weights, optimizer
state, version) and the calls after it are replayed, in order, so the trainer stands where it stood:
at ``Run.published`` (its weights bit for bit, when training is deterministic: the run compares the checksums of
the version published again with the lost trainer's). The published version is published again (what the old worker held is gone with
it) and a Train or checkpoint that was in flight is submitted again. Those replays are the steps redone;
no batch is lost, and none counts twice (each trained once into the trainer that goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

from rollart_dask import compat
from rollart_dask.compat import CommClosedError
from rollart_dask.data import tasks
from rollart_dask.observe import console


FINAL_TRIES, FINAL_WAIT_S = 3, 5.0  # the run's last checkpoint: a disk that fills may be freed by then


class TrainerLost(Exception):
    """A trainer call's worker left before it ended; it is submitted again once the trainer is re-created."""


@dataclass
class Replay:
    version: int  # the trainer's version once this call is done
    stage: str
    fn: Callable
    args: tuple


def _trainer_ready(dask_worker=None) -> bool:
    from rollart_dask.data.plugins import TRAINER

    plugin = dask_worker.plugins.get(TRAINER)
    return plugin is not None and plugin.service is not None


def _version_of(result) -> int:
    return result if isinstance(result, int) else int(result["version"])


class TrainerRecovery:
    """Given the run's status (its version, counters, how it fails) and, once set up, its services: not the run."""

    def __init__(self, cfg, status):
        self.cfg, self.status = cfg, status
        self.services = None  # (attach: wired at set-up, after this is made)
        self.base: str | None = None  # the checkpoint the log starts from (None: the model's own weights, version 0)
        self.log: list[Replay] = []  # trainer calls since then, in order
        self.healthy, self.down = asyncio.Event(), asyncio.Event()  # (exactly one is set)
        self.healthy.set()
        self._task: asyncio.Task | None = None
        self._lost: str | None = None  # the trainer's worker being replaced
        self.seen_comm = None  # the client's scheduler connection the membership watch last saw
        self._sent_to: dict[str, str] = {}  # a trainer call's key → the trainer's worker it was sent to

    # -- what the run tells it ------------------------------------------------------------------------
    def attach(self, services) -> None:
        self.services = services

    def trained(self, version: int, stage: str, fn: Callable, *args) -> None:
        self.log.append(Replay(version, stage, fn, args))

    def checkpointed(self, path: str, version: int) -> None:
        self.base = path
        self.log = [r for r in self.log if r.version > version]

    def trainer_lost(self, address: str) -> None:
        """From the membership watch: re-create the trainer (a second loss during the first re-creation starts it over)."""
        self.healthy.clear()
        self.down.set()
        self.services.weights.trainer_lost()
        if self._task is not None:
            self._task.cancel()
        self._lost = address
        self._task = asyncio.ensure_future(self._recover(address))

    def connection_lost(self) -> None:
        """The client lost the scheduler (called before distributed cancels every future the client holds; the scheduler
        forgets their results). The trainer lives on in its worker: once the client is back, the run asks where it
        stands, publishes again what the scheduler forgot, and submits again a Train or checkpoint that was in flight (a
        Train that ran meanwhile answers again, it trains nothing twice: data/tasks.py)."""
        self.healthy.clear()
        self.down.set()
        self.services.weights.trainer_lost()
        recovering = self._lost if self._task is not None and not self._task.done() else None  # its futures went too: it starts over
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.ensure_future(self._reconnected(recovering))

    def watch_connection(self) -> Callable[[], None]:
        """Be told at once when the client loses the scheduler (distributed has no public hook: its reconnect is wrapped);
        returns what undoes it. The membership watch also sees a new connection (control/membership.py)."""
        client = self.services.client

        def first():
            self.connection_lost()
            self.seen_comm = None

        # on distributed's race (dialled back before the scheduler had dropped the old stream, whose end then closed the
        # new one) its report loop stops unless it is connected now: dial again
        return compat.wrap_reconnect(client, first, lambda: _dial_again(client))

    async def _reconnected(self, recovering: str | None) -> None:
        status, s, t0 = self.status, self.services, time.monotonic()
        console.print("[yellow]the client lost its connection to the scheduler: waiting for it to reconnect[/yellow]")
        try:
            deadline = t0 + self.cfg.rollout.worker_wait_s
            while s.client.status != "running":
                if s.client.status in ("closing", "closed") or time.monotonic() > deadline:
                    raise ConnectionError(
                        f"the client did not reconnect within rollout.worker_wait_s={self.cfg.rollout.worker_wait_s:.0f} s "
                        f"(status {s.client.status})"
                    )
                await asyncio.sleep(0.1)
            status.counts["scheduler_reconnects"] += 1
            if recovering is not None:
                return await self._recover(recovering)
            version = await s.d.submit_one("trainer-settled", tasks.trainer_settled, pool="TRAIN", worker=s.trainer)
            if version not in (status.published, status.published + 1):  # (+1: the Train in flight ran; it answers again when resubmitted)
                raise RuntimeError(f"the trainer stands at v{version}, the run at v{status.published}")
            status.counts["train_ran_while_disconnected"] += version > status.published
            s.weights.publishing = None  # forgotten; nothing to order a Train after now: the trainer is settled
            if version == status.published and s.proxy.version < status.published:  # what the engines still need, forgotten
                s.weights.publish(status.published, s.proxy.pool_of, setup=True)
                await s.weights.publishing
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the run ends, saying why
            status.fail(
                RuntimeError(
                    f"the client lost the scheduler and the run could not go on ({type(e).__name__}: {e}); restart the run with --resume"
                )
            )
            return
        self.down.clear()
        self.healthy.set()
        console.print(f"reconnected to the scheduler in {time.monotonic() - t0:.1f} s; the trainer stands at v{version}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def checkpoint(self, root: Path, version: int, after=None, final: bool = False) -> str | None:
        """Save the trainer's checkpoint ``root/step-{version}`` (after the Train future ``after``); once whole it is the
        replay's base and ``root/latest``. A write that fails with an OSError (a full disk) is said and counted
        (``checkpoint_failed``): the run goes on from the last good one (None). The run's final checkpoint is tried
        ``FINAL_TRIES`` times, ``FINAL_WAIT_S`` apart, and then ends the run with that error."""
        s, path = self.services, root / f"step-{version}"

        async def submit(after=None):  # (again on a re-created trainer: it stands at this version, no Train is in flight)
            return s.d.submit_one("checkpoint", tasks.trainer_checkpoint, str(path.resolve()), after, pool="TRAIN", worker=s.trainer)

        for attempt in range(1, FINAL_TRIES + 1 if final else 2):
            try:
                saved, _ = await self.result(submit, await self.submit(lambda: submit(after)))
                break
            except OSError as e:
                if isinstance(e, CommClosedError):  # (an OSError too) the cluster, not the disk
                    raise
                self.status.counts["checkpoint_failed"] += 1
                last = f"the last good one is {self.base}" if self.base else "there is none yet"
                if final and attempt == FINAL_TRIES:
                    raise OSError(
                        e.errno,
                        f"the run's final checkpoint could not be written to {path} after {FINAL_TRIES} tries "
                        f"({e}); {last} (rollart run --resume continues from it)",
                    ) from e
                console.print(
                    f"[yellow]checkpoint v{version} could not be written to {path} ({e}); {last}"
                    f"{f': trying again in {FINAL_WAIT_S:.0f} s' if final else ': the run goes on'}[/yellow]"
                )
                if not final:
                    return None
                after = None
                await asyncio.sleep(FINAL_WAIT_S)
        pointer = root / "latest.tmp"  # written whole, then renamed: a crash never leaves an empty or half pointer
        pointer.write_text(saved)
        os.replace(pointer, root / "latest")
        self.checkpointed(saved, version)
        return saved

    # -- calls that outlive the trainer's worker ------------------------------------------------------
    async def result(self, submit: Callable[[], Awaitable], fut=None, timeout: float = 600, step: bool = False):
        """The result of a trainer call (``fut``, else ``submit()``) and the Dask future that gave it, submitted again with ``submit`` on the re-created
        trainer when the trainer's worker leaves before it ends (``step``: a Train, counted as a step redone). The run's
        fatal error (a trainer that could not be re-created) as soon as there is one."""
        while True:
            await self._ready()
            if fut is not None and self._sent_to.pop(getattr(fut, "key", None), self.services.trainer) != self.services.trainer:
                asyncio.ensure_future(self.services.d.client.cancel([fut]))  # sent to a trainer re-created since: it would wait
                fut = None  # for its lost worker for ever (Dask cannot run a task pinned there); sent again to the new one
                self.status.counts["steps_redone"] += step
            try:
                if fut is None:
                    fut = await submit()
                return await self._unless_lost(fut, timeout), fut
            except TrainerLost:  # (a Train submitted again to the trainer that ran it answers, it is not redone: data/tasks.py)
                fut = None
                self.status.counts["steps_redone" if self._lost else "train_resubmitted"] += step

    async def submit(self, submit: Callable[[], Awaitable]):
        """``submit()``'s future, or None when the trainer is (found) lost: ``result`` then submits it again once re-created.
        (A batch sent to a worker that just died fails before the monitor has seen it go; one scattered to it while it
        dies waits for it up to Dask's 30 s connect timeout, and the trainer is re-created meanwhile: both are sent again.)"""
        if self.down.is_set():
            return None
        trainer, attempt = self.services.trainer, asyncio.ensure_future(submit())
        try:
            done = await _first(attempt, self.down.wait(), self.status.failing.wait())
        except asyncio.CancelledError:
            attempt.cancel()
            raise
        if attempt not in done:  # lost (or the run failed) while it was being sent: ``result`` sends it again, or raises
            attempt.cancel()
            return None
        try:
            fut = attempt.result()
        except Exception:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_first(self.down.wait(), self.status.failing.wait()), 3)
            if self.down.is_set() or self.services.trainer != trainer:
                return None
            raise
        if hasattr(fut, "key"):
            self._sent_to[fut.key] = trainer
        return fut

    async def submit_train(self, samples: list[dict], after=None, batch_id: str | None = None):
        """A Train on the trainer's worker, ordered after ``after`` (the publish it starts from). The batch goes straight to
        that worker, not through the scheduler inside the task's graph (a batch of 2,048 samples is ~45 MiB: the scheduler
        stalled forwarding it, and Dask warned every step)."""
        s = self.services
        key = f"train-batch-{uuid.uuid4().hex}"  # named by its stage, like every key of the run
        batch = (await s.d.client.scatter({key: samples}, workers=[s.trainer], direct=True))[key]
        max_lag = self.cfg.rollout.lag_bound  # (the trainer's own guard of rollout.max_trained_lag)
        return s.d.submit_one("train", tasks.trainer_step, batch, after, batch_id, max_lag, pool="TRAIN", worker=s.trainer)

    async def _ready(self) -> None:
        status = self.status
        while not self.healthy.is_set():
            await _first(self.healthy.wait(), status.failing.wait())
            if status.fatal:
                raise status.fatal

    async def _unless_lost(self, fut, timeout: float):
        status = self.status
        waiter = asyncio.ensure_future(fut)
        done = await _first(waiter, self.down.wait(), status.failing.wait(), timeout=timeout)
        if waiter in done and not waiter.cancelled() and waiter.exception() is None:
            return waiter.result()
        if waiter in done:  # failed: if the trainer's worker is gone, the monitor says so within moments
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_first(self.down.wait(), status.failing.wait()), 3)
        waiter.cancel()
        if status.fatal:
            raise status.fatal
        if self.down.is_set():
            if hasattr(fut, "key"):  # pinned to the lost worker, it would wait in the scheduler for ever
                asyncio.ensure_future(self.services.d.client.cancel([fut]))
            raise TrainerLost()
        if waiter.done() and not waiter.cancelled():
            raise waiter.exception()
        raise TimeoutError(f"the trainer gave no answer within {timeout:.0f} s")

    # -- re-creation ----------------------------------------------------------------------------------
    async def _recover(self, lost: str) -> None:
        status, s = self.status, self.services
        name, t0 = s.poolmap.name(lost), time.monotonic()
        console.print(
            f"[yellow]the trainer's worker {name} was lost: re-creating the trainer from "
            f"{self.base or 'the model'} and replaying {len(self.log)} trainer calls[/yellow]"
        )
        try:
            address = await self._replacement(lost)
            s.trainer = s.weights.trainer = address
            version, last = 0, None
            if self.base is not None:
                last = s.d.submit_one("restore", tasks.trainer_restore, self.base, pool="TRAIN", worker=address)
                version = await last
            for r in [r for r in self.log if r.version > version]:
                if r.stage == "train":
                    last = await self.submit_train(*r.args)
                else:
                    last = s.d.submit_one(r.stage, r.fn, *r.args, pool="TRAIN", worker=address)
                version = _version_of(await last)
                if version != r.version:
                    raise RuntimeError(f"the replayed {r.stage} left the trainer at v{version}, not v{r.version}")
                status.counts["steps_redone"] += r.stage == "train"
            if version != status.published:
                raise RuntimeError(f"the trainer stands at v{version} after its replay, the run at v{status.published}")
            before = s.weights.digests.get(status.published)
            s.weights.publish(status.published, s.proxy.pool_of, after=last, setup=True)  # what the lost worker held
            after = [b["sha256"] for b in (await s.weights.publishing)["buckets"]]
            same = "unknown" if before is None else "identical" if before == after else "different"
            status.counts[f"trainer_replay_{same}"] += 1  # deterministic training replays bit for bit
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the run ends, saying why
            status.fail(
                RuntimeError(
                    f"worker {name} holding the trainer was lost and the trainer could not be re-created "
                    f"({type(e).__name__}: {e}); restart the run with --resume"
                )
            )
            return
        status.counts["trainer_recovered"] += 1
        self._lost = None
        self.down.clear()
        self.healthy.set()
        console.print(
            f"trainer re-created on {s.poolmap.name(address)} at v{status.published} in {time.monotonic() - t0:.1f} s "
            f"(weights {same} to the lost trainer's)"
        )

    async def _replacement(self, lost: str) -> str:
        """A TRAIN worker other than ``lost`` whose trainer is built, within rollout.worker_wait_s."""
        deadline = time.monotonic() + self.cfg.rollout.worker_wait_s
        while True:
            workers = (await self.services.client.scheduler.identity())["workers"]
            train = [a for a, w in workers.items() if a != lost and "TRAIN" in w.get("resources", {})]
            if train:
                ready = await self.services.client.run(_trainer_ready, workers=train)
                found = [a for a in train if ready.get(a)]
                if found:
                    self.services.poolmap.workers.update({a: workers[a] for a in found})
                    return found[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no TRAIN worker with a trainer within rollout.worker_wait_s={self.cfg.rollout.worker_wait_s:.0f} s")
            await asyncio.sleep(0.5)


async def _dial_again(client, tries: int = 20) -> None:
    for _ in range(tries):
        await asyncio.sleep(0.5)
        try:
            await compat.dial_scheduler(client)
            if client.status == "running":
                return
        except (OSError, AssertionError):
            pass
    console.print(f"[red]the client could not reconnect to the scheduler after {tries} tries[/red]")


async def _first(*awaitables, timeout: float | None = None) -> set:
    """Wait for the first of ``awaitables`` to end; the others (those made here) are cancelled. The set of those done."""
    futs = [a if asyncio.isfuture(a) else asyncio.ensure_future(a) for a in awaitables]
    done, pending = await asyncio.wait(futs, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for f, a in zip(futs, awaitables):
        if f in pending and f is not a:
            f.cancel()
    return done
