"""The run's side of weight transfer, one contract for every store.

After a Train the trainer publishes version n (bucketed, manifest with checksums) and every
engine stages it in the background: the loop does not wait, engines keep generating with
n−1 and the next Train starts as soon as the publish has read the weights. Before the next
Suspend the loop waits for what is not staged yet (``waited_s``; rollout and that Train go on
meanwhile), then Update only swaps. Both figures are cut from the same two instants, so that
0 ≤ ``waited_s`` ≤ ``transfer_s`` by construction: the transfer runs from the publish's start on the
trainer, right after the Train (``t0``), to the client holding the last engine's answer (``done``; wall
clock, both), and ``waited_s`` is the part of that window during which the loop was waiting for it
(from ``max(t0, the loop started waiting)`` to ``done``). ``hidden_s = transfer_s − waited_s`` is the
part done before the loop needed it.

``weights.pull: at_update`` is the synchronous baseline: the stage tasks are sent only when the loop asks for
the version, with generation suspended (Run.suspend), so all of the transfer is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import Counter
from pathlib import Path

from rollart_dask.config import WeightsConfig
from rollart_dask.data.weights import worker
from rollart_dask.data.weights.buckets import WeightsIntegrityError
from rollart_dask.data.weights.delta import DeltaUnavailable
from rollart_dask.data.weights.mooncake import LocalMaster, close_clients


LOST_GRACE_S = 3.0  # how long a failed transfer waits to learn that the trainer's worker was lost (the scheduler's remove-worker event: control/membership.py)


class WeightStore:
    def __init__(self, cfg: WeightsConfig, dispatcher, trainer: str, run_dir: Path):
        self.cfg, self.d, self.trainer, self.run_dir = cfg, dispatcher, trainer, Path(run_dir)
        self.master: LocalMaster | None = None
        self._staging: asyncio.Future | None = None
        self._deferred = None  # pull=at_update: the stage of the latest version, sent when the loop asks for it
        self.publishing = None  # the Dask future of the latest publish task (on the trainer's worker)
        self._closed = False
        self.transfers: list[dict] = []  # one per staged version (metrics rows and the run summary)
        self.prefix = f"rollart/{uuid.uuid4().hex[:12]}"  # keys of this run, should the master be shared
        # the last two versions' (publish future, buckets future | None, deltas future | None, a delta published): what a
        # joining engine stages (the futures: store=dask; with mooncake the buckets and deltas are keys in the store)
        self._kept: dict[int, tuple] = {}
        self._trainer_base: int | None = None  # weights.delta: the version the trainer published last (its next is diffed to it)
        self._engine_base: dict[str, int] = {}  # weights.delta: engine → the version it staged last (a delta applies to it)
        self.lost: set[str] = set()  # engines that left: a stage of theirs that fails is not the transfer's failure
        self._in_flight: dict = {}  # engine → its stage task of the version being pulled
        self._joining: dict = {}  # engine → its stage task while it joins (control/elastic.py)
        self.digests: dict[int, list[str]] = {}  # the last versions' bucket checksums (a re-created trainer's are compared)
        self._replacing: asyncio.Future | None = None  # the trainer was lost: what a wait for the transfer waits on instead
        self.counts: Counter = Counter()  # (the run's counts)

    @property
    def kind(self) -> str:
        return self.cfg.store

    async def start(self) -> None:
        if self.kind == "mooncake" and not self.cfg.mooncake.master:  # the embedded default runs its own master
            self.master = await asyncio.to_thread(LocalMaster(self.run_dir / "mooncake_master.log").start)

    def spec(self) -> dict:
        """What the workers' side needs (plain data, sent with each task)."""
        spec = {
            "store": self.kind,
            "bucket_mb": self.cfg.bucket_mb,
            "keep_versions": self.cfg.keep_versions,
            "prefix": self.prefix,
            "pull": self.cfg.pull,
            "delta": self.cfg.delta,
        }
        if self.kind == "mooncake":
            mc = self.cfg.mooncake
            spec.update(
                master=self.master.master if self.master else mc.master,
                metadata_server=self.master.metadata_server if self.master else mc.metadata_server,
                protocol=mc.protocol,
                device=mc.device,
                segment_mb=mc.segment_mb,
                buffer_mb=mc.buffer_mb,
                log_dir=str((self.run_dir / "mooncake").resolve()) if self.master else None,
            )
        return spec

    def publish(self, version: int, engines: dict[str, str], after=None, setup: bool = False) -> None:
        """Publish ``version`` once ``after`` (the Train future) is done and stage it on ``engines`` (address → pool).
        The whole chain is submitted now — publish on the trainer, then every engine's stage task taking the
        publish's futures as arguments — so it goes on without the client, ahead of the next Train on the
        trainer's worker; ``publishing`` (the publish task's future) is what that Train is ordered after.
        ``setup``: published before rollout (warm start, resume), left out of the run's means."""
        if self._staging is not None and not self._staging.done() and self._staging is not self._replacing:
            raise RuntimeError(f"weights v{version} published while the previous version is still being staged")
        spec = {**self.spec(), "engine_pools": sorted(engines.values())}  # (an emulated engine times its pull by them)
        published = self.publishing = self.d.submit_one(
            "publish-weights", worker.trainer_publish, version, spec, after, pool="TRAIN", worker=self.trainer
        )
        buckets = deltas = None
        with_delta = self.cfg.delta and self._trainer_base == version - 1  # (worker._diff decides the same on the trainer)
        if self.kind == "dask":  # the buckets as one Dask result on the trainer; each engine's task fetches it peer-to-peer
            buckets = self.d.submit_one("weights-bucket", worker.trainer_buckets, version, published, pool="TRAIN", worker=self.trainer)
            if with_delta:
                deltas = self.d.submit_one(
                    "weights-delta", worker.trainer_delta_buckets, version, published, pool="TRAIN", worker=self.trainer
                )
        self._trainer_base = version
        self._kept = {v: k for v, k in self._kept.items() if v >= version - 1}
        self._kept[version] = (published, buckets, deltas, with_delta)
        # read as soon as the publish ends, not when its staging starts (pulled at Update, that waits for the next
        # step): a trainer lost in between is compared with what it published
        asyncio.ensure_future(self._record_digest(version, published))

        def stage() -> None:  # (``engines`` read now: pulled at Update, engines that joined meanwhile get it too)
            staged = {a: self._stage(version, a, p, spec) for a, p in list(engines.items())}
            self._in_flight = dict(staged)
            # pulled at Update, the transfer begins with this submission; in the background, where the publish began
            submitted = time.time() if self.cfg.pull == "at_update" and not setup else None
            staging = asyncio.ensure_future(self._timed(version, published, staged, setup, submitted, dict(engines), spec))
            if self._replacing is not None:  # the re-created trainer's publish: a wait for the lost one's gets this one
                _chain(staging, self._replacing)
                staging, self._replacing = self._replacing, None
            self._staging = staging

        if self.cfg.pull == "at_update" and not setup:
            self._deferred = stage
        else:
            stage()

    def _stage(self, version: int, address: str, pool: str, spec: dict, full: bool = False):
        """The stage task of ``version`` on one engine: its delta when the engine staged the version before it (and
        one was published), else the full version."""
        published, buckets, deltas, with_delta = self._kept[version]
        use_delta = not full and with_delta and self._engine_base.get(address) == version - 1
        if self.kind == "dask":
            fn, data = (worker.engine_stage_dask_delta, deltas) if use_delta else (worker.engine_stage_dask, buckets)
            return self.d.submit_one("stage-weights", fn, published, data, spec, pool=pool, worker=address)
        return self.d.submit_one("stage-weights", worker.engine_stage_mooncake, published, spec, use_delta, pool=pool, worker=address)

    def stage_on(self, address: str, pool: str, version: int, engine_pools: list[str]):
        """Stage ``version`` (one of the last two published) on one engine, e.g. one that joined; its Dask future.
        ``engine_pools``: every engine's pool (an emulated engine times its pull by them)."""
        if version not in self._kept:
            raise RuntimeError(f"weights v{version} are no longer kept for a joining engine (kept: {sorted(self._kept)})")
        fut = self._joining[address] = self._stage(version, address, pool, {**self.spec(), "engine_pools": sorted(engine_pools)})
        return fut

    def engine_lost(self, address: str) -> None:
        """A stage task pinned to a departed engine would wait for it for ever (Dask keeps it, no worker can run it):
        cancelled, it ends the wait, and the transfer goes on without that engine."""
        self.lost.add(address)
        self._engine_base.pop(address, None)
        for staging in (self._in_flight, self._joining):
            fut = staging.pop(address, None)
            if fut is not None and not fut.done():
                asyncio.ensure_future(self.d.client.cancel([fut]))

    def trainer_lost(self) -> None:
        """The trainer's worker is gone, and what it published with it (Dask cannot recompute a publish): the stages in
        flight are cancelled, and a wait for the transfer waits for the re-created trainer's publish instead
        (control/recovery.py publishes the same version again)."""
        published = [f for kept in self._kept.values() for f in kept[:3] if f is not None]  # pinned to the lost worker: never done
        for fut in [*self._in_flight.values(), *self._joining.values(), *published]:
            if not fut.done():
                asyncio.ensure_future(self.d.client.cancel([fut]))
        self._in_flight, self._joining, self._kept, self._deferred = {}, {}, {}, None
        self._trainer_base = None  # the re-created trainer has no version to diff against: its first publish is full
        old, self._replacing = self._staging, asyncio.get_running_loop().create_future()
        self._staging = self._replacing
        if old is not None and not old.done():
            old.cancel()

    async def _record_digest(self, version: int, published) -> None:
        with contextlib.suppress(Exception):  # a publish lost with its worker has no checksums to compare
            manifest = await published
            self.digests = {v: d for v, d in self.digests.items() if v >= version - 2}
            self.digests[version] = [b["sha256"] for b in manifest["buckets"]]

    async def _timed(self, version: int, published, staged: dict, setup: bool, submitted: float | None, engines: dict, spec: dict) -> dict:
        """The transfer's window in wall-clock time from instants that a busy client loop cannot move later: the
        stage's submission (pulled at Update) or the publish's start on the trainer (in the background), to the
        moment the client holds every engine's answer. (Timing the start where this coroutine first ran shortened
        the window by however long the loop took to get to it.)"""
        manifest = await published
        t0 = submitted if submitted is not None else manifest["started_at"]
        t_published = max(t0, time.time())
        results = await self._gather_staged(version, staged, engines, spec)
        rows = [r for r in results if not isinstance(r, BaseException)]
        done = time.time()
        return {
            "store": self.kind,
            "version": version,
            "bytes": manifest["bytes"],
            "delta_bytes": (manifest.get("delta") or {}).get("bytes"),  # (weights.delta: what an engine at version − 1 pulls)
            "engines_delta": sum(bool(r.get("delta")) for r in rows),
            "bytes_moved": sum(r.get("bytes", manifest["bytes"]) for r in rows),
            "adapter": manifest.get("adapter", False),
            "buckets": len(manifest["buckets"]),
            "engines": len(rows),
            "publish_s": manifest["publish_s"],
            "pull_s": done - t_published,
            "stage_s": max((r["stage_s"] for r in rows), default=0.0),
            "transfer_s": done - t0,
            "setup": setup,
            "_window": (t0, done),
        }

    async def _gather_staged(self, version: int, staged: dict, engines: dict, spec: dict, tries: int = 3) -> list:
        """Every engine's stage answer (a lost engine's: its error). With Mooncake, stages that found no bucket (the master
        was restarted: it knows no object of before) are sent again once the trainer has put its kept copy back."""
        for attempt in itertools.count(1):
            addresses = list(staged)
            results = await asyncio.gather(*(staged[a] for a in addresses), return_exceptions=True)
            failed = {a: r for a, r in zip(addresses, results) if isinstance(r, BaseException) and a not in self.lost}
            for a, r in zip(addresses, results):
                if not isinstance(r, BaseException):
                    self._engine_base[a] = version
            undeltable = [a for a, e in failed.items() if isinstance(e, (DeltaUnavailable, WeightsIntegrityError)) and spec["delta"]]
            if undeltable and attempt < tries:  # a delta that could not be applied, or rebuilt wrong: the full version instead
                self.counts["weights_delta_fallbacks"] += len(undeltable)
                for a in undeltable:
                    self._engine_base.pop(a, None)
                    staged[a] = self._restage(version, a, engines[a], spec, staged[a])
                continue
            if not failed:
                return results
            error = next(iter(failed.values()))
            if self.kind != "mooncake" or attempt == tries or not isinstance(error, KeyError):
                raise error
            await self.d.submit_one("republish-weights", worker.trainer_put_again, version, spec, pool="TRAIN", worker=self.trainer)
            self.counts["weights_put_again"] += 1
            for a in failed:
                staged[a] = self._restage(version, a, engines[a], spec, staged[a])

    def _restage(self, version: int, address: str, pool: str, spec: dict, previous):
        """The full version staged again on one engine, in place of its ``previous`` stage task."""
        fut = self._stage(version, address, pool, spec, full=True)
        if self._in_flight.get(address) is previous:  # (what engine_lost cancels)
            self._in_flight[address] = fut
        return fut

    async def wait_staged(self) -> dict:
        """Before Update: wait for the rest of the pull (``waited_s``; rollout and training go on meanwhile); its transfer record.
        A publish or stage that fails raises here; one that takes longer than ``weights.timeout_s`` is an error naming it."""
        if self._deferred is not None:  # pull=at_update: the transfer starts now, generation suspended
            self._deferred, stage = None, self._deferred
            stage()
        if self._staging is None:
            raise RuntimeError("no weights were published to swap in")
        t0 = time.time()
        while True:
            staging = self._staging
            try:
                row = await asyncio.wait_for(asyncio.shield(staging), self.cfg.timeout_s)
                break
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"weights were not staged on every engine within weights.timeout_s={self.cfg.timeout_s:.0f} s "
                    f"(store {self.kind}; a lost engine or trainer worker, or a transfer slower than that)"
                ) from None
            except (Exception, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # the run stops
                # a worker that leaves fails its tasks before the run's monitor sees it go: if it held the trainer, the
                # re-created trainer's publish of the same version replaces this transfer within moments (trainer_lost)
                deadline = time.monotonic() + LOST_GRACE_S
                while staging is self._staging and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                if staging is self._staging:
                    raise
        start, done = row["_window"]  # the transfer's own instants (_timed): waited_s is the part of it the loop waited through
        waited = max(0.0, done - max(start, t0))
        row = {**{k: v for k, v in row.items() if k != "_window"}, "waited_s": waited, "hidden_s": row["transfer_s"] - waited}
        self.transfers.append(row)
        return row

    def summary(self) -> dict:
        """Means over the run's transfers during training (those of warm start or resume, before rollout, left out)."""
        rows = [r for r in self.transfers if not r["setup"]]
        if not rows:
            return {"store": self.kind, "transfers": 0}
        mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
        transfer, waited = mean("transfer_s"), mean("waited_s")
        return {
            "store": self.kind,
            "transfers": len(rows),
            "bytes": rows[-1]["bytes"],
            "adapter": rows[-1]["adapter"],
            "buckets": rows[-1]["buckets"],
            "engines": rows[-1]["engines"],
            "publish_s": mean("publish_s"),
            "pull_s": mean("pull_s"),
            "transfer_s": transfer,
            "waited_s": waited,
            "hidden_fraction": max(0.0, 1 - waited / transfer) if transfer > 0 else 0.0,
            **self._delta_summary(rows),
        }

    def _delta_summary(self, rows: list[dict]) -> dict:
        """weights.delta: the mean delta of a version against its full bytes, and the share of engine pulls that were deltas."""
        if not self.cfg.delta:
            return {}
        deltas = [r["delta_bytes"] for r in rows if r.get("delta_bytes")]
        pulls = sum(r["engines"] for r in rows)
        return {
            "delta_bytes": sum(deltas) / len(deltas) if deltas else None,
            "delta_pulls": sum(r["engines_delta"] for r in rows) / pulls if pulls else 0.0,
            "bytes_moved": sum(r["bytes_moved"] for r in rows),
        }

    async def close(self) -> None:
        """Idempotent: the run's stop and, after a failed set-up, its caller both call it."""
        if self._closed:
            return
        self._closed = True
        if self._staging is not None and not self._staging.done():
            self._staging.cancel()
        if self.kind == "mooncake":  # workers unmount their segments while the master still answers
            try:
                await asyncio.wait_for(self.d.client.run(close_clients), 30)
            except Exception:  # noqa: BLE001 - a worker already gone has nothing to unmount
                pass
        if self.master is not None:
            await asyncio.to_thread(self.master.stop)
            self.master = None


def _chain(source: asyncio.Future, target: asyncio.Future) -> None:
    """``target`` ends as ``source`` does; cancelling ``target`` cancels ``source``."""

    def copy(f: asyncio.Future) -> None:
        if target.done():
            return
        if f.cancelled():
            target.cancel()
        elif f.exception() is not None:
            target.set_exception(f.exception())
        else:
            target.set_result(f.result())

    source.add_done_callback(copy)
    target.add_done_callback(lambda t: source.cancel() if t.cancelled() else None)
