"""Answers straight back to the caller, over a Dask comm the caller opened to this worker.

A batch task (data/tasks.py) is placed by the scheduler like any task, but its items' answers do not
travel as the task's result: the caller would have to *gather* it (two more messages through the
scheduler, and a slot held until then), and streamed items — answered one by one as each is done —
would be relayed through the scheduler as events. Instead each dispatcher opens one comm to each
service worker it pins calls to (the ``rollart-answers`` handler, installed on every worker by
``AnswersPlugin``) and the worker writes on it the answers its items finish in one event-loop tick,
pickled together. The scheduler sees only the tasks; every batch is still in its task stream.

Answers are put from service threads; they leave on the worker's event loop (``post`` is thread-safe).
"""
from __future__ import annotations

import logging
import pickle
import threading

from distributed import WorkerPlugin
from distributed.batched import BatchedSend

log = logging.getLogger("rollart_dask")

HANDLER = "rollart-answers"  # the worker handler a dispatcher calls to open its channel
PLUGIN = "rollart-answers"


class NoChannel(RuntimeError):
    """The caller has no answer channel to this worker (it never opened one, or it closed)."""


class Channels:
    """The answer channels of one worker: topic (one per dispatcher) → a batched comm to its client."""

    def __init__(self, worker):
        self.worker = worker
        self._open: dict[str, BatchedSend] = {}
        self._outbox: dict[str, list] = {}  # topic → answers not yet sent
        self._lock = threading.Lock()

    async def open(self, comm, topic: str):
        """The handler: keep ``comm`` as ``topic``'s channel. The worker's handler loop goes on reading it (the
        caller sends nothing more: its closing the comm ends the channel)."""
        for gone in [t for t, s in self._open.items() if s.closed()]:  # channels of callers that have left (runs that ended)
            del self._open[gone]
        send = BatchedSend(interval="1ms", loop=self.worker.loop)
        send.start(comm)
        old, self._open[topic] = self._open.get(topic), send
        if old is not None:
            old.abort()
        return "ok"  # after the channel is held: the caller submits tasks only once it reads this

    def check(self, topic: str) -> None:
        send = self._open.get(topic)
        if send is None or send.closed():
            raise NoChannel(f"no answer channel for {topic} on worker {self.worker.address}")

    def post(self, topic: str, cid, result: tuple | None) -> None:
        """Queue one answer (any thread); answers queued within one event-loop tick leave together."""
        self.post_many(topic, [(cid, result)])

    def post_many(self, topic: str, answers: list) -> None:
        with self._lock:
            pending = self._outbox.setdefault(topic, [])
            first = not pending
            pending.extend(answers)
        if first:
            self.worker.loop.add_callback(self._flush, topic)

    def _flush(self, topic: str) -> None:
        with self._lock:
            answers = self._outbox.pop(topic, [])
        send = self._open.get(topic)
        if not answers or send is None:
            return
        try:
            send.send(pickle.dumps(answers, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:  # the caller went away: its calls are over
            log.debug("answer channel %s closed: %s", topic, e)
            self._open.pop(topic, None)

class AnswersPlugin(WorkerPlugin):
    """Installs the answer channels' handler on every worker (and again on a restarted one). Registering it
    again (each dispatcher does, once) keeps the channels other dispatchers have open on the worker."""

    name = PLUGIN

    def setup(self, worker):
        existing = getattr(worker.handlers.get(HANDLER), "__self__", None)
        self.channels = existing if isinstance(existing, Channels) else Channels(worker)
        worker.handlers[HANDLER] = self.channels.open


def channels(worker) -> Channels:
    plugin = worker.plugins.get(PLUGIN)
    if plugin is None:
        raise NoChannel(f"worker {worker.address} has no answer channels (plugin {PLUGIN} not registered)")
    return plugin.channels
