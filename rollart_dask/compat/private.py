"""distributed's private API, one named function per use (compat/hooks.py lists them for ``check``)."""

from __future__ import annotations

from typing import Awaitable, Callable

from distributed import Nanny
from distributed.batched import BatchedSend
from distributed.comm import CommClosedError as CommClosedError  # (raised by the comms handed out here)
from distributed.comm import connect
from distributed.core import Status
from distributed.deploy.subprocess import SubprocessScheduler

NO_REPLY = Status.dont_reply  # a worker handler's return value that keeps the comm open and sends nothing back
SchedulerSubprocess = SubprocessScheduler  # subclassed by resource/cluster.py, which overrides its ``_start``


# -- the client's scheduler connection (control/recovery.py, control/telemetry.py, chaos faults)
def wrap_reconnect(client, first: Callable[[], None], on_race: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Call ``first`` as soon as ``client`` starts to reconnect, before it dials (distributed has no public hook); an
    AssertionError of its dial (its race: the scheduler had not yet dropped the old stream) runs ``on_race``.
    Returns what undoes the wrap."""
    reconnect = client._reconnect

    async def told_first():
        first()
        try:
            await reconnect()
        except AssertionError:
            await on_race()

    client._reconnect = told_first
    return lambda: client.__dict__.pop("_reconnect", None)


async def dial_scheduler(client) -> None:
    """Dial the scheduler again with the client's own timeout; OSError/AssertionError as distributed raises them."""
    try:
        await client._ensure_connected(timeout=client._timeout)
    except (OSError, AssertionError):
        client.scheduler_comm = None  # (a half-made connection distributed would otherwise keep)
        raise


def scheduler_connection(client):
    """The client's current connection to the scheduler: a new object after every reconnect."""
    return client.scheduler_comm


async def cut_scheduler_connection(client) -> None:
    """Close the client's connection as a network blip would (the client dials again by itself)."""
    await client.scheduler_comm.comm.close()


# -- the pinned-call channels (control/dispatch.py, data/channels.py)
async def open_comm(address: str, connection_args: dict):
    return await connect(address, **connection_args)


def batched_send(comm, loop=None) -> BatchedSend:
    """A started BatchedSend on ``comm``: what is sent within a millisecond goes in one write."""
    send = BatchedSend(interval="1ms", loop=loop)
    send.start(comm)
    return send


def worker_handler(worker, name: str):
    return worker.handlers.get(name)


def set_worker_handler(worker, name: str, handler) -> None:
    """A comm handler on ``worker``: a peer that writes {"op": name, …} reaches ``handler(comm, …)``."""
    worker.handlers[name] = handler


# -- the scheduler's diagnostics (data/channels.py's BatchesFeed)
def task_stream(scheduler):
    """The task-stream plugin, where one is kept (the dashboard or ``get_task_stream`` started it); else None."""
    return scheduler.plugins.get("task-stream")


def file_in_task_stream(stream, record: dict, look_back: int = 10_000) -> None:
    """Into the task stream's buffer where its stop time puts it: the buffer is searched by stop time (bisection)
    and a batch is reported up to a second after it ended, after tasks that ended later."""
    buf, stop = stream.buffer, record["startstops"][0]["stop"]
    i = len(buf)
    while i > 0 and len(buf) - i < look_back and max(s["stop"] for s in buf[i - 1]["startstops"]) > stop:
        i -= 1
    if i == len(buf):
        buf.append(record)
    else:
        if len(buf) == buf.maxlen:
            buf.popleft()  # (what a full buffer's append would have dropped)
            i -= 1
        buf.insert(max(i, 0), record)
    stream.index += 1  # (the count its readers page by)


def charge_span(scheduler, span_ids, metric: tuple, seconds: float) -> bool:
    """Add ``seconds`` to the fine performance metric ``metric`` of the deepest of ``span_ids`` the scheduler knows;
    False when it knows none (a span holding no task of its own)."""
    spans = scheduler.extensions.get("spans")
    known = spans and next((spans.spans[i] for i in reversed(span_ids or ()) if i in spans.spans), None)
    if not known:
        return False
    known._cumulative_worker_metrics[metric] += seconds
    return True


def plugin_names(dask_scheduler) -> dict[str, list[str]]:
    """Run on the scheduler: the names of its plugins and of the worker and nanny plugins it hands to workers."""
    return {
        "scheduler": sorted(dask_scheduler.plugins),
        "worker": sorted(dask_scheduler.worker_plugins),
        "nanny": sorted(dask_scheduler.nanny_plugins),
    }


# -- the embedded cluster's processes (chaos faults)
def nanny_of(worker_address: str):
    """The Nanny in this process that runs the worker at ``worker_address`` (None: none here)."""
    return next((n for n in list(Nanny._instances) if n.worker_address == worker_address), None)


def stand_down(nanny) -> None:
    """Its worker's exit closes the Nanny instead of restarting the worker."""
    nanny.status = Status.closing_gracefully


async def correct_state(cluster) -> None:
    """Start the workers added to ``cluster.worker_spec`` (what ``scale`` schedules, awaited)."""
    await cluster._correct_state()
