"""Control plane → data plane calls: one awaitable per logical call, Dask futures underneath.

With ``coalesce`` off, every call is its own batch (the design card's shape). With it on, calls
to the same service that arrive in one event-loop tick share one batch, each still resolved on
its own: a few messages per tick instead of one per trajectory.

Calls pinned to a worker (every generate, env and reward call of a run: the worker was chosen by
pool when the trajectory's env or engine was) go over the dispatcher's own comm to that worker and
are answered on it (data/channels.py): no scheduler between, nothing gathered. Each batch is still
reported to the scheduler, which shows it in the task stream and its span. A ``streamed`` call
goes further: the worker only *starts* the items; each item's answer leaves as soon as it is
ready, so one slow env.step (or one long generation) never holds back the calls that shared its
batch — without it a coalesced batch is a barrier, which trajectory-level asynchrony must not have.
A call to a pool alone, and a route of several tasks (prefill → decode), are Dask tasks placed by
the scheduler (a pool call takes its answers from the task's result).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import pickle
import time
import uuid
from collections import defaultdict

from distributed import wait

from rollart_dask import compat
from rollart_dask.control.phases import first_caller_span, task_key, within
from rollart_dask.data.channels import BATCHES_TOPIC, FEED, HANDLER, PLUGIN, BatchesFeed, ChannelsPlugin
from rollart_dask.data.tasks import failure, run_batch
from rollart_dask.resource.pools import submit_kwargs


class CallFailed(RuntimeError):
    """The service answered with an error for this item."""


class WorkerLost(RuntimeError):
    """The worker holding this call's state left the cluster."""


log = logging.getLogger("rollart_dask")
SWEEP_S = 0.1  # the resolution of call timeouts


class Dispatcher:
    def __init__(self, client, coalesce: bool = True, max_inflight: int = 2):
        self.client, self.coalesce, self.max_inflight = client, coalesce, max_inflight
        self._pending: dict[tuple, list] = {}
        self._inflight: dict[tuple, int] = defaultdict(int)  # coalescing key → batch futures in flight
        self._by_worker: dict[str, set] = defaultdict(set)  # pinned worker → its open item futures
        self._dask: dict[str, set] = defaultdict(set)  # pinned worker → its dask futures (the prefill/decode route's)
        self.calls = 0
        self.futures = 0
        self._tasks: set[asyncio.Task] = set()
        self.latency: dict[str, list[float]] = defaultdict(list)  # stage → seconds per call, since last drain
        self.batch_sizes: dict[str, list[int]] = defaultdict(list)
        self._bucket_span: dict[tuple, dict | None] = {}  # coalescing key → Dask span of the pending batch's first call
        self.topic = f"rollart-calls-{uuid.uuid4().hex[:12]}"  # names this dispatcher's channels on the workers
        self._answers: dict[int, asyncio.Future] = {}  # call id → its future, until its answer arrives on a channel
        self._ids = itertools.count()
        self._channels: dict[str, asyncio.Future] = {}  # worker → (comm, its BatchedSend), once opening started
        self._readers: set[asyncio.Task] = set()
        self._plugin: asyncio.Future | None = None  # the channels' handler on every worker, registered once
        self._deadlines: dict[asyncio.Future, tuple] = {}  # open call → (its tick on the wheel, stage, where, timeout)
        self._wheel: dict[int, set] = defaultdict(set)  # tick (SWEEP_S) → the open calls that time out in it
        self._frees: dict[int, tuple[str, object]] = {}  # batch (its first call id) → (worker, frees its slot)
        self._sweeper: asyncio.Task | None = None

    # -- channels (data/channels.py) ---------------------------------------------------------------------
    def _channel(self, worker: str) -> asyncio.Future:
        ch = self._channels.get(worker)
        if ch is None:
            ch = self._channels[worker] = asyncio.ensure_future(self._open_channel(worker))
        return ch

    async def _register(self) -> None:
        await self.client.register_plugin(ChannelsPlugin(), name=PLUGIN)
        try:
            await self.client.register_plugin(BatchesFeed(), name=FEED)
        except Exception as e:  # the scheduler cannot import rollart_dask: batches stay out of its task stream and spans
            log.warning(
                "batches will not show in the scheduler's task stream (%s: %s); they are still its %r events",
                type(e).__name__,
                e,
                BATCHES_TOPIC,
            )

    async def _open_channel(self, worker: str):
        if self._plugin is None or (self._plugin.done() and self._plugin.exception() is not None):
            self._plugin = asyncio.ensure_future(self._register())
        await asyncio.shield(self._plugin)
        comm = await compat.open_comm(worker, self.client.connection_args)
        try:
            await comm.write({"op": HANDLER, "topic": self.topic, "reply": False})
            reply = await comm.read()  # the handler holds the channel before it answers: batches may go from now
            if reply != "ok":
                raise RuntimeError(f"worker {worker} refused a channel: {reply}")
        except BaseException:
            comm.abort()
            raise
        send = compat.batched_send(comm)  # the batches of one tick (to every service on this worker) in one write
        reader = asyncio.ensure_future(self._read_answers(worker, comm))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return comm, send

    async def _read_answers(self, worker: str, comm) -> None:
        try:
            while True:
                for payload in await comm.read():  # one BatchedSend write: the pickled answers of one or more ticks
                    for cid, result in pickle.loads(payload):
                        if type(cid) is tuple:  # ("free", first call id): the batch started (streamed) or ended
                            release = self._frees.pop(cid[1], None)
                            if release is not None:
                                release[1]()
                            continue
                        fut = self._answers.pop(cid, None)
                        if fut is not None and not fut.done():
                            fut.set_result(result)
        except Exception as e:  # the worker left or closed: calls still open there cannot be answered
            if self._channels.get(worker) is not None and self._channels[worker].done():
                self._channels.pop(worker, None)  # the next call opens a new one
            why = failure(ConnectionError(f"channel to {worker} closed: {type(e).__name__}"))
            for fut in list(self._by_worker.get(worker, ())):
                if not fut.done():
                    fut.set_result(why)
            for first, (w, release) in list(self._frees.items()):  # their batches will never say they are done
                if w == worker:
                    release()

    def close(self) -> None:
        for ch in self._channels.values():
            if ch.done() and not ch.cancelled() and ch.exception() is None:
                ch.result()[1].abort()
            else:
                ch.cancel()
        self._channels.clear()
        for r in self._readers:
            r.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def drain_stats(self) -> dict:
        """Per-stage call latency (p50/p99, ms) and items per future since the last drain."""
        out = {}
        for stage, xs in self.latency.items():
            xs = sorted(xs)
            if xs:
                sizes = self.batch_sizes.get(stage) or [1]
                out[stage] = {
                    "n": len(xs),
                    "p50_ms": 1e3 * xs[len(xs) // 2],
                    "p99_ms": 1e3 * xs[min(len(xs) - 1, int(len(xs) * 0.99))],
                    "sum_s": sum(xs),
                    "items_per_future": sum(sizes) / len(sizes),
                }
        self.latency.clear()
        self.batch_sizes.clear()
        return out

    async def call(
        self, stage: str, fn, item: dict, pool: str, worker: str | None = None, timeout: float | None = None, streamed: bool = False
    ):
        """Run ``fn([item])[0]`` on a worker of ``pool`` (or exactly ``worker``); raise CallFailed on an item error.
        Pinned calls run as ``fn(items, channel)`` on the worker, answering each item on this dispatcher's channel
        (``streamed``: as soon as each is done, see the module doc). ``fn`` may also be a route with
        ``submit(client, args, streamed) -> future`` (control/proxy.PDRoute: a prefill task, then a decode task on ``worker``
        that takes its future); ``pool``/``worker`` are then the last task's. The dispatcher owns ``item`` from here."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.calls += 1
        key = (stage, fn, pool, worker, streamed)
        if worker is not None:
            cid = item["_cid"] = next(self._ids)
            self._answers[cid] = fut
            self._by_worker[worker].add(fut)
        elif streamed:
            raise ValueError(f"a streamed call must be pinned to a worker ({stage} on pool {pool})")
        if self.coalesce:
            bucket = self._pending.setdefault(key, [])
            bucket.append((item, fut))
            if len(bucket) == 1:
                self._bucket_span[key] = first_caller_span()
                loop.call_soon(self._flush, key)
        else:
            self._launch(key, [(item, fut)])
        if timeout is not None:
            tick = int((loop.time() + timeout) / SWEEP_S) + 1  # swept once that tick has begun: never early
            self._deadlines[fut] = (tick, stage, worker or pool, timeout)
            self._wheel[tick].add(fut)
            if self._sweeper is None:
                self._sweeper = asyncio.ensure_future(self._sweep())
        t0 = time.perf_counter()
        try:
            # ``fut`` itself, not wait_for: on Python 3.11 wait_for returns the result when the caller is cancelled
            # in the tick its answer lands, swallowing the cancel (a cancelled trajectory would go on holding its
            # env slot). A cancelled caller cancels ``fut``: a flush still pending drops the item (_flush).
            status, value = await fut
            self.latency[stage].append(time.perf_counter() - t0)
        finally:
            timer = self._deadlines.pop(fut, None)
            if timer is not None:
                self._wheel.get(timer[0], set()).discard(fut)
            if worker is not None:
                self._by_worker[worker].discard(fut)
                self._answers.pop(item["_cid"], None)
        if status != "ok":
            raise CallFailed(f"{stage}: {value}")
        return value

    async def _sweep(self) -> None:
        """One timer for every open call, a wheel of SWEEP_S ticks: each sweep takes the calls of the ticks that have
        begun since the last, never the others (an asyncio timeout per call costs a timer handle and heap work each)."""
        loop = asyncio.get_running_loop()
        swept = min(self._wheel, default=int(loop.time() / SWEEP_S) + 1) - 1  # from the earliest open call's tick
        while True:
            await asyncio.sleep(SWEEP_S)
            now = int(loop.time() / SWEEP_S)
            for tick in range(swept + 1, now + 1):
                for fut in self._wheel.pop(tick, ()):
                    timer = self._deadlines.pop(fut, None)
                    if timer is not None and not fut.done():
                        _, stage, where, timeout = timer
                        fut.set_exception(TimeoutError(f"{stage} on {where} gave no answer in {timeout:.0f}s"))
            swept = now

    def _flush(self, key: tuple) -> None:
        # At most max_inflight batches per service: later calls wait and join the next, larger batch
        # (a service runs one batch at a time anyway; more futures would only queue behind it).
        if self._inflight[key] >= self.max_inflight:
            return
        span = self._bucket_span.pop(key, None)
        batch = [(item, f) for item, f in self._pending.pop(key, []) if not f.done()]  # callers cancelled or timed out meanwhile
        if not batch:
            return
        self._inflight[key] += 1
        try:
            with within(span):  # not the span of whatever triggered this flush
                self._launch(key, batch, done=lambda: self._batch_done(key))
        except Exception as e:  # nothing was launched: give the slot back and answer every caller
            self._batch_done(key)
            for _, f in batch:
                if not f.done():
                    f.set_result(failure(e))

    def _batch_done(self, key: tuple) -> None:
        self._inflight[key] -= 1
        if self._pending.get(key):
            self._flush(key)

    def _launch(self, key: tuple, batch: list, done=None) -> None:
        stage, fn, pool, worker, streamed = key
        self.batch_sizes[stage].append(len(batch))
        if worker is None or hasattr(fn, "submit"):  # a pool call, or a route of tasks (proxy.PDRoute)
            if worker is not None and streamed and done is not None:  # the decode task frees the slot when it starts
                done = self._free_slot(worker, batch[0][0]["_cid"], done)
            self._track(self._submit(key, batch), batch, worker, done)
            return
        self.futures += 1
        # One pickle: the task key and span ids (for the task stream and fine metrics: a batch of rollout and evaluation
        # items is counted under its first caller's span), the function and the items.
        span = first_caller_span()  # (inside _flush: the batch's first caller's)
        payload = pickle.dumps(
            (task_key(stage), span and span["ids"], fn, [item for item, _ in batch], streamed), protocol=pickle.HIGHEST_PROTOCOL
        )
        ch = self._channel(worker)
        if ch.done() and ch.exception() is None:
            ch.result()[1].send(payload)  # raises where the channel closed: _flush then frees the slot
            if done is not None:  # (its marker cannot come before this returns: one event loop)
                self._free_slot(worker, batch[0][0]["_cid"], done)
        else:  # the first call to this worker: open its channel, then send
            if done is not None:
                self._free_slot(worker, batch[0][0]["_cid"], done)
            task = asyncio.ensure_future(self._send_when_open(ch, worker, payload, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_when_open(self, ch: asyncio.Future, worker: str, payload: bytes, batch: list) -> None:
        try:
            (await ch)[1].send(payload)
        except Exception as e:  # no channel: every call of the batch fails, and its slot is free
            if self._channels.get(worker) is ch:
                self._channels.pop(worker, None)  # the next call tries again
            for _, f in batch:
                if not f.done():
                    f.set_result(failure(e))
            held = self._frees.get(batch[0][0]["_cid"])
            if held is not None:
                held[1]()

    def _free_slot(self, worker: str, first_cid: int, done):
        """A batch holds its service's slot until the worker says it is free of it — started (streamed: its
        answers come one by one, later) or done — or its channel breaks. Called at most once either way."""
        held = [True]

        def release() -> None:
            if held:
                held.clear()
                self._frees.pop(first_cid, None)
                done()

        self._frees[first_cid] = (worker, release)
        return release

    def _submit(self, key: tuple, batch: list):
        stage, fn, pool, worker, streamed = key
        items = [item for item, _ in batch]
        chained = getattr(fn, "submit", None)  # a route of several tasks (proxy.PDRoute: prefill, then decode on another worker)
        if chained is not None:  # its last task answers on this dispatcher's channel
            self.futures += 2
            return self._chain_when_open(chained, items, worker, streamed)
        self.futures += 1
        payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)  # one bytes object (data/tasks.run_batch)
        return self.client.submit(run_batch, fn, payload, **submit_kwargs(pool, worker, key=task_key(stage)))

    async def _chain_when_open(self, chained, items: list, worker: str, streamed: bool):
        ch = self._channel(worker)
        try:
            await ch  # the channel must exist before its task answers on it
        except Exception:
            if self._channels.get(worker) is ch:
                self._channels.pop(worker, None)
            raise
        return chained(self.client, (items, self.topic), streamed)

    def _track(self, submitted, batch: list, worker: str | None, done) -> None:
        task = asyncio.ensure_future(self._collect(submitted, [f for _, f in batch], worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            task.add_done_callback(lambda _: done())

    async def _collect(self, submitted, futs: list, worker: str | None) -> None:
        """Wait for a batch task. Pool calls take their answers from its result; pinned calls were (or will
        be) answered on the channel, so the task is only waited for, never gathered, and fails only the
        calls it did not answer."""
        dfut = None
        try:
            dfut = await submitted if inspect.iscoroutine(submitted) else submitted
            if worker is None:
                results = await dfut
            else:
                self._dask[worker].add(dfut)
                await wait(dfut)
                if dfut.status == "finished":
                    return
                error = await dfut.exception() if dfut.status == "error" else None
                results = [failure(error or RuntimeError(f"batch task {dfut.key} {dfut.status}"))] * len(futs)
        except Exception as e:  # the task itself failed (worker died, deserialisation, no channel…)
            results = [failure(e)] * len(futs)
        finally:
            if worker is not None and dfut is not None:
                self._dask[worker].discard(dfut)
        for f, r in zip(futs, results):
            if not f.done():
                f.set_result(tuple(r))

    def open_calls(self) -> dict:
        """Calls waiting for an answer, by stage (coalescing buckets not yet flushed included)."""
        pending = {k[0]: len(v) for k, v in self._pending.items()}
        return {"pending_flush": pending, "futures_in_flight": len(self._tasks)}

    def worker_lost(self, address: str) -> int:
        """Fail every open call pinned to a departed worker (its tasks would wait in no-worker)."""
        futs = self._by_worker.pop(address, set())
        for f in futs:
            if not f.done():
                f.set_exception(WorkerLost(f"worker {address} left the cluster"))
        for key in [k for k in self._pending if k[3] == address]:  # (stage, fn, pool, worker, streamed)
            self._pending.pop(key)
        ch = self._channels.pop(address, None)
        if ch is not None:
            ch.add_done_callback(lambda c: c.cancelled() or c.exception() or c.result()[1].abort())
        for worker, release in [v for v in self._frees.values() if v[0] == address]:
            release()
        lost = list(self._dask.pop(address, set()))
        if lost:  # their results can never arrive; cancelling ends the collectors waiting on them
            asyncio.ensure_future(self.client.cancel(lost))
        return len(futs)

    def submit_one(self, stage: str, fn, *args, pool: str, worker: str | None = None):
        """A single non-batched task (weights, training, control calls); returns the Dask future."""
        self.futures += 1
        return self.client.submit(fn, *args, **submit_kwargs(pool, worker, key=task_key(stage)))
