"""The dispatcher's races, on the shared local cluster: a caller cancelled in the tick its answer lands,
callers gone before their batch is flushed, and a batch that fails to launch after taking its slot."""

import asyncio
import threading

import pytest
from distributed import Client

from rollart_dask.control.dispatch import CallFailed, Dispatcher


def test_a_caller_cancelled_as_its_answer_lands_stops(address, run_async):
    """Python 3.11's wait_for returns the result when the cancel comes in the tick the answer lands: the
    cancelled trajectory went on (holding its env slot). Here the cancel comes in exactly that tick."""

    def echo(items):
        return [("ok", item["n"]) for item in items]

    async def go():
        async with Client(address, asynchronous=True) as client:
            d = Dispatcher(client, coalesce=True)
            try:
                victim: asyncio.Task | None = None

                async def trigger():  # first in the batch: its answer's wake-up runs just before the victim's
                    await d.call("echo", echo, {"n": 0}, pool="CPU", timeout=60)
                    victim.cancel()

                async def member():
                    await d.call("echo", echo, {"n": 1}, pool="CPU", timeout=60)
                    return "went on after its cancel"

                first = asyncio.ensure_future(trigger())
                victim = asyncio.ensure_future(member())
                await first
                return await asyncio.gather(victim, return_exceptions=True)
            finally:
                d.close()

    (outcome,) = run_async(go(), timeout=120)
    assert isinstance(outcome, asyncio.CancelledError), outcome


def test_callers_gone_before_the_flush_leave_the_batch(address, run_async):
    def batch_size(items):
        return [("ok", len(items)) for _ in items]

    async def go():
        async with Client(address, asynchronous=True) as client:
            d = Dispatcher(client, coalesce=True)
            try:
                calls = [asyncio.ensure_future(d.call("size", batch_size, {"n": i}, pool="CPU", timeout=60)) for i in range(3)]

                async def cancel_two():  # runs in the tick the three calls joined their bucket, before its flush
                    calls[1].cancel()
                    calls[2].cancel()

                await asyncio.ensure_future(cancel_two())
                results = await asyncio.gather(*calls, return_exceptions=True)
                return results, d.drain_stats()["size"]
            finally:
                d.close()

    results, stats = run_async(go(), timeout=120)
    assert isinstance(results[1], asyncio.CancelledError) and isinstance(results[2], asyncio.CancelledError)
    assert results[0] == 1, f"the batch carried {results[0]} items: cancelled callers were sent to the worker"
    assert stats["items_per_future"] == 1.0


def test_a_batch_that_cannot_launch_fails_its_callers_and_frees_its_slot(address, run_async):
    def echo(items):
        return [("ok", item["n"]) for item in items]

    async def go():
        async with Client(address, asynchronous=True) as client:
            d = Dispatcher(client, coalesce=True, max_inflight=1)
            try:
                with pytest.raises(CallFailed, match="pickle"):  # an item that cannot be pickled: the launch raises
                    await d.call("echo", echo, {"n": 0, "lock": threading.Lock()}, pool="CPU", timeout=20)
                # the one slot of this service is free again: the next call is answered, not timed out
                return await d.call("echo", echo, {"n": 7}, pool="CPU", timeout=20)
            finally:
                d.close()

    assert run_async(go(), timeout=120) == 7
