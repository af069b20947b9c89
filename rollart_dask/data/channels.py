"""Calls straight to a service worker and answers straight back, over one Dask comm per caller and worker.

The calls of a run are pinned: each trajectory's env lives on one CPU worker, its generation on one
engine. Sending those as Dask tasks makes the scheduler place what is already placed — a graph update,
about ten messages and two batching delays per batch — so each dispatcher opens one comm to each service
worker it pins calls to (the ``rollart-calls`` handler, installed on every worker by ``ChannelsPlugin``)
and sends its batches on it; the worker answers on the same comm, the answers of one event-loop tick
pickled together. Nothing is gathered, and the scheduler relays nothing.

A batch still shows in the Dask dashboard: the worker reports each one (key, start, stop, thread) about
once a second as a ``rollart-batches`` event, which the RollArt dashboard's scheduler plugin files into
the task stream and the batch's span (serve/dashboard/plugin.py). Calls to a pool alone, and the
two-task prefill/decode route, remain Dask tasks; the latter answer on the channel too (``reply`` a topic).

Worker side: a streamed batch starts on the event loop (its fast items inline, the rest on the service's
pool, see data/tasks.py); any other batch runs on the worker's thread pool. A batch frees its caller's
slot with a ("free", first call id) marker: when it has started (streamed) or is done.
"""

from __future__ import annotations

import contextvars
import logging
import pickle
import threading
import time

from dask.utils import key_split
from distributed import SchedulerPlugin, WorkerPlugin

from rollart_dask import compat

log = logging.getLogger("rollart_dask")

HANDLER = "rollart-calls"  # the worker handler a dispatcher calls to open its channel
PLUGIN = "rollart-channels"
BATCHES_TOPIC = "rollart-batches"  # the workers' reports of the batches they ran (BatchesFeed files them)
FEED = "rollart-batches"
ACTIVITY = "rollart-batch"  # the fine performance metrics' activity of a batch's time
REPORT_S = 1.0

here: contextvars.ContextVar = contextvars.ContextVar("rollart_worker")  # the worker running a channel's batch


def failure(e: BaseException) -> tuple[str, str]:
    """A per-item error answer: the control plane decides retry or fail from it."""
    return ("err", f"{type(e).__name__}: {e}")


class NoChannel(RuntimeError):
    """The caller has no channel to this worker (it never opened one, or it closed)."""


class Channel:
    """One caller's comm on this worker: its batches come in, their answers go out (``post``: any thread)."""

    def __init__(self, channels: "Channels", topic: str, send):
        self.channels, self.worker, self.topic, self.send = channels, channels.worker, topic, send
        self._outbox: list = []
        self._open: dict = {}  # call id → its batch's record [key, span, start, items left, thread]
        self._lock = threading.Lock()

    def closed(self) -> bool:
        return self.send.closed()

    def post(self, cid, result: tuple | None) -> None:
        self.post_many([(cid, result)])

    def post_many(self, answers: list) -> None:
        """Queue answers (any thread); those queued within one event-loop tick leave together."""
        finished = []
        with self._lock:
            first = not self._outbox
            self._outbox.extend(answers)
            for cid, _ in answers:
                rec = self._open.pop(cid, None)
                if rec is not None:
                    rec[3] -= 1
                    if rec[3] == 0:
                        finished.append(rec)
        if finished:
            self.channels.finished(finished)
        if first:
            self.worker.loop.add_callback(self._flush)

    def _flush(self) -> None:
        with self._lock:
            answers, self._outbox = self._outbox, []
        if not answers or self.send.closed():
            return
        try:
            self.send.send(pickle.dumps(answers, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # the caller went away: its calls are over
            log.debug("channel %s closed: %s", self.topic, e)

    def run(self, payload: bytes) -> None:
        """One batch from the caller: (task key, span ids, fn, items, streamed); runs ``fn(items, self)``."""
        key, span, fn, items, streamed = pickle.loads(payload)
        if not items:
            return
        first = items[0]["_cid"]
        rec = [key, span, time.time(), len(items), threading.get_ident()]
        with self._lock:
            for item in items:
                self._open[item["_cid"]] = rec
        if streamed:  # starts its items and returns (answers come as each is done)
            self._guarded(fn, items, first)
        else:
            ctx = contextvars.copy_context()
            self.worker.executors["default"].submit(ctx.run, self._blocking, fn, items, first, rec)

    def _blocking(self, fn, items: list, first: int, rec: list) -> None:
        rec[4] = threading.get_ident()
        self._guarded(fn, items, first)
        self.post(("free", first), None)

    def _guarded(self, fn, items: list, first: int) -> None:
        token = here.set(self.worker)
        try:
            fn(items, self)
        except Exception as e:  # the batch itself failed (no such service, …): every item says why
            self.post_many([(item["_cid"], failure(e)) for item in items] + [(("free", first), None)])
        finally:
            here.reset(token)


class Channels:
    """The channels of one worker: topic (one per dispatcher) → Channel; and the report of batches run."""

    def __init__(self, worker):
        self.worker = worker
        self._open: dict[str, Channel] = {}
        self._done: list = []  # records of finished batches, not yet reported
        self._lock = threading.Lock()
        self._reporter = None

    def get(self, topic: str) -> Channel:
        ch = self._open.get(topic)
        if ch is None or ch.closed():
            raise NoChannel(f"no channel for {topic} on worker {self.worker.address}")
        return ch

    async def open(self, comm, topic: str):
        """The handler, for the comm's whole life: hold it as ``topic``'s channel, then run what the caller sends
        on it until it closes (the caller's closing the comm ends the channel)."""
        for gone in [t for t, c in self._open.items() if c.closed()]:  # channels of callers that have left (runs that ended)
            del self._open[gone]
        await comm.write("ok")  # the caller sends batches only once it reads this
        send = compat.batched_send(comm, loop=self.worker.loop)
        ch = Channel(self, topic, send)
        old, self._open[topic] = self._open.get(topic), ch
        if old is not None:
            old.send.abort()
        self._start_reporting()
        try:
            while True:
                for payload in await comm.read():  # the caller's BatchedSend: one or more batches per write
                    try:
                        ch.run(payload)
                    except Exception as e:  # a batch that cannot even be read: its calls time out, say why here
                        log.exception("batch on channel %s could not be run: %s", topic, e)
        except (compat.CommClosedError, OSError):
            pass
        finally:
            send.abort()
            if self._open.get(topic) is ch:
                del self._open[topic]
            self.report()  # what the caller ran, at once (a run that just ended)
        return compat.NO_REPLY

    def finished(self, recs: list) -> None:
        now = time.time()
        with self._lock:
            self._done.extend((key, span, start, now, thread) for key, span, start, _, thread in recs)

    def _start_reporting(self) -> None:
        if self._reporter is None:
            from tornado.ioloop import PeriodicCallback

            self._reporter = PeriodicCallback(self.report, REPORT_S * 1000)
            self._reporter.start()

    def report(self) -> None:
        """The batches finished since the last report, as one event to the scheduler (the task stream's source)."""
        with self._lock:
            done, self._done = self._done, []
        if done:
            self.worker.log_event(BATCHES_TOPIC, {"batches": done})


class ChannelsPlugin(WorkerPlugin):
    """Installs the channels' handler on every worker (and again on a restarted one). Registering it again
    (each dispatcher does, once) keeps the channels other dispatchers have open on the worker."""

    name = PLUGIN
    idempotent = True

    def setup(self, worker):
        existing = getattr(compat.worker_handler(worker, HANDLER), "__self__", None)
        self.channels = existing if isinstance(existing, Channels) else Channels(worker)
        compat.set_worker_handler(worker, HANDLER, self.channels.open)


class BatchesFeed(SchedulerPlugin):
    """On the scheduler: files the batches workers report into the task stream (where one is kept: the dashboard
    or ``get_task_stream`` started it) and their time into the fine performance metrics of their span — the
    deepest of the batch's spans the scheduler knows (one holding no task of its own is unknown to it)."""

    name = FEED
    idempotent = True

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler

    def log_event(self, topic: str, msg) -> None:
        if topic != BATCHES_TOPIC or not isinstance(msg, dict):
            return
        stream = compat.task_stream(self.scheduler)
        worker = msg.get("worker")
        for key, span_ids, start, stop, thread in msg.get("batches", ()):
            key = tuple(key) if isinstance(key, list) else key  # (msgpack made the tuple a list)
            if stream is not None:
                compat.file_in_task_stream(
                    stream,
                    {
                        "key": key,
                        "worker": worker,
                        "thread": thread,
                        "status": "OK",
                        "nbytes": 0,
                        "startstops": ({"action": "compute", "start": start, "stop": stop},),
                    },
                )
            compat.charge_span(self.scheduler, span_ids, ("execute", key_split(key), ACTIVITY, "seconds"), stop - start)


def channels(worker) -> Channels:
    plugin = worker.plugins.get(PLUGIN)
    if plugin is None:
        raise NoChannel(f"worker {worker.address} has no channels (plugin {PLUGIN} not registered)")
    return plugin.channels
