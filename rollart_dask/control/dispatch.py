"""Control plane → data plane calls: one awaitable per logical call, Dask futures underneath.

With ``coalesce`` off, every call is its own future (the design card's shape). With it on,
calls to the same service that arrive in one event-loop tick share one future (a batch
task), each still resolved on its own: the scheduler sees a few tasks per tick instead of
one per trajectory (PLATFORM.md: ~15x control-plane throughput on 2 cores).

A ``streamed`` call goes further: its task only *starts* the work on the worker and returns at
once; each item's answer comes back on its own, as soon as it is ready, as an event on this
dispatcher's topic (``log_event`` → ``subscribe_topic``). So one slow env.step (or one long
generation) never holds back the calls that shared its batch — without it a coalesced batch
is a barrier, which is exactly what trajectory-level asynchrony must not have.
"""
from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from collections import defaultdict

from rollart_dask.control.phases import current_span_id, first_caller_span, within
from rollart_dask.data.tasks import failure
from rollart_dask.resource.pools import submit_kwargs


def task_key(stage: str):
    """A task's key, named by its stage: ``stage-<id>``, or inside a span ``("stage-<span id>", "<id>")``.

    The scheduler files a task under the span of its TaskGroup, and a string key's group is just the
    stage: the train task of step 12 would join the span of step 11's train task if that one is
    still alive. A group per (stage, span) keeps each step and phase in its own span; Dask's
    ``key_split`` of either form is still the stage, so the task stream colours and groups by stage.
    """
    token = uuid.uuid4().hex[:12]
    span_id = current_span_id()
    return f"{stage}-{token}" if span_id is None else (f"{stage}-{span_id.replace('-', '')}", token)


class CallFailed(RuntimeError):
    """The service answered with an error for this item."""


class WorkerLost(RuntimeError):
    """The worker holding this call's state left the cluster."""


class Dispatcher:
    def __init__(self, client, coalesce: bool = True, max_inflight: int = 2):
        self.client, self.coalesce, self.max_inflight = client, coalesce, max_inflight
        self._pending: dict[tuple, list] = {}
        self._inflight: dict[tuple, int] = defaultdict(int)  # coalescing key → batch futures in flight
        self._by_worker: dict[str, set] = defaultdict(set)  # pinned worker → its open item futures
        self._dask: dict[str, set] = defaultdict(set)  # pinned worker → its dask futures
        self.calls = 0
        self.futures = 0
        self._tasks: set[asyncio.Task] = set()
        self.latency: dict[str, list[float]] = defaultdict(list)  # stage → seconds per call, since last drain
        self.batch_sizes: dict[str, list[int]] = defaultdict(list)
        self._bucket_span: dict[tuple, dict | None] = {}  # coalescing key → Dask span of the pending batch's first call
        self.topic = f"rollart-calls-{uuid.uuid4().hex[:12]}"  # streamed answers for this dispatcher only
        self._streamed: dict[str, asyncio.Future] = {}  # call id → its future, until its answer arrives
        client.subscribe_topic(self.topic, self._on_answer)

    def _on_answer(self, event) -> None:
        _, answers = event  # [(call id, pickled answer), ...]: what one worker finished in one tick
        for cid, payload in answers:
            fut = self._streamed.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result(tuple(pickle.loads(payload)))

    def close(self) -> None:
        try:
            self.client.unsubscribe_topic(self.topic)
        except Exception:
            pass  # the client is already closing

    def drain_stats(self) -> dict:
        """Per-stage call latency (p50/p99, ms) and items per future since the last drain."""
        out = {}
        for stage, xs in self.latency.items():
            xs = sorted(xs)
            if xs:
                sizes = self.batch_sizes.get(stage) or [1]
                out[stage] = {"n": len(xs), "p50_ms": 1e3 * xs[len(xs) // 2], "p99_ms": 1e3 * xs[min(len(xs) - 1, int(len(xs) * 0.99))],
                              "sum_s": sum(xs),
                              "items_per_future": sum(sizes) / len(sizes)}
        self.latency.clear()
        self.batch_sizes.clear()
        return out

    async def call(self, stage: str, fn, item, pool: str, worker: str | None = None, timeout: float | None = None, streamed: bool = False):
        """Run ``fn([item])[0]`` on a worker of ``pool`` (or exactly ``worker``); raise CallFailed on an item error.
        ``streamed``: ``fn(items, topic)`` starts the items and answers each on ``topic`` (see the module doc).
        ``fn`` may also be a route with ``submit(client, args, streamed) -> future`` (control/proxy.PDRoute: a prefill
        task, then a decode task on ``worker`` that takes its future); ``pool``/``worker`` are then the last task's."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.calls += 1
        key = (stage, fn, pool, worker, streamed)
        cid = None
        if streamed:
            cid = uuid.uuid4().hex
            item = dict(item, _cid=cid)
            self._streamed[cid] = fut
        if worker is not None:
            self._by_worker[worker].add(fut)
        if self.coalesce:
            bucket = self._pending.setdefault(key, [])
            bucket.append((item, fut))
            if len(bucket) == 1:
                self._bucket_span[key] = first_caller_span()
                loop.call_soon(self._flush, key)
        else:
            self._launch(key, [(item, fut)])
        t0 = time.perf_counter()
        try:
            # not wait_for: on Python 3.11 it returns the result when the caller is cancelled in the tick its
            # answer lands, swallowing the cancel (a cancelled trajectory would go on holding its env slot).
            # A cancelled caller cancels ``fut``: a flush still pending drops the item (_flush).
            async with asyncio.timeout(timeout):
                status, value = await fut
            self.latency[stage].append(time.perf_counter() - t0)
        except TimeoutError:
            raise TimeoutError(f"{stage} on {worker or pool} gave no answer in {timeout:.0f}s") from None
        finally:
            if worker is not None:
                self._by_worker[worker].discard(fut)
            if cid is not None:
                self._streamed.pop(cid, None)
        if status != "ok":
            raise CallFailed(f"{stage}: {value}")
        return value

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
        args = ([item for item, _ in batch], self.topic) if streamed else ([item for item, _ in batch],)
        # A coalesced batch is one task: it carries its first caller's span (rollout and evaluation
        # items sharing a batch are counted under the first one's).
        chained = getattr(fn, "submit", None)  # a route of several tasks (proxy.PDRoute: prefill, then decode on another worker)
        if chained is not None:
            dfut = chained(self.client, args, streamed)
            self.futures += 2
        else:
            dfut = self.client.submit(fn, *args, **submit_kwargs(pool, worker, key=task_key(stage)))
            self.futures += 1
        self.batch_sizes[stage].append(len(batch))
        if worker is not None:
            self._dask[worker].add(dfut)
        task = asyncio.ensure_future(self._collect(dfut, [f for _, f in batch], worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            task.add_done_callback(lambda _: done())

    async def _collect(self, dfut, futs: list, worker: str | None) -> None:
        try:
            results = await dfut
        except Exception as e:  # the task itself failed (worker died, deserialisation…)
            results = [failure(e)] * len(futs)
        finally:
            if worker is not None:
                self._dask[worker].discard(dfut)
        if not isinstance(results, list):  # a streamed batch started: its items answer as events
            return
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
        lost = list(self._dask.pop(address, set()))
        if lost:  # their results can never arrive; cancelling ends the collectors waiting on them
            asyncio.ensure_future(self.client.cancel(lost))
        return len(futs)

    def submit_one(self, stage: str, fn, *args, pool: str, worker: str | None = None):
        """A single non-batched task (weights, training, control calls); returns the Dask future."""
        self.futures += 1
        return self.client.submit(fn, *args, **submit_kwargs(pool, worker, key=task_key(stage)))
