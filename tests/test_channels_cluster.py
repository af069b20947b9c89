"""Pinned calls and their answers travel over the dispatcher's own comm to each worker (data/channels.py), not
through the scheduler: what happens when that comm breaks, when a task finds no channel, when nothing answers;
and that each batch still shows in the scheduler's task stream and its span's fine performance metrics."""

import asyncio
import pickle
import time
from contextlib import asynccontextmanager

import pytest
from dask.utils import key_split
from distributed import Client, span

from rollart_dask.control.dispatch import CallFailed, Dispatcher
from rollart_dask.data import plugins, tasks
from rollart_dask.data.channels import NoChannel
from rollart_dask.resource.pools import PoolMap, submit_kwargs


def _reset(name: str, seconds: float = 0.0) -> dict:
    return {
        "traj_id": name,
        "env": "synthetic",
        "env_args": {},
        "seed": 1,
        "member": "0",
        "inject": {"reset_latency": {"dist": "constant", "s": seconds}, "time_scale": 1.0},
    }


async def _env_worker(client) -> str:
    await client.register_plugin(plugins.EnvHostPlugin(["CPU"]), name=plugins.ENVHOST)
    return PoolMap.from_scheduler_info(await client.scheduler.identity()).members("CPU")[0]


@asynccontextmanager
async def _dispatcher(address):
    """A client, a CPU worker with an env host, and a dispatcher closed at the end: (client, worker, dispatcher)."""
    async with Client(address, asynchronous=True) as client:
        cpu = await _env_worker(client)
        d = Dispatcher(client)
        try:
            yield client, cpu, d
        finally:
            d.close()


def test_a_broken_channel_fails_its_open_calls_and_the_next_call_opens_a_new_one(address, run_async):
    async def go():
        async with _dispatcher(address) as (client, cpu, d):

            def call(name, s):
                return d.call("env-reset", tasks.env_reset_stream, _reset(name, s), pool="CPU", worker=cpu, timeout=60, streamed=True)

            await call("warm", 0.0)  # opens the channel
            slow = asyncio.ensure_future(call("slow", 3.0))
            await asyncio.sleep(0.5)  # its task has started; its answer would come on the channel
            t0 = time.monotonic()
            (await d._channels[cpu])[0].abort()  # the comm breaks (the worker's side sees it closed)
            failed = await asyncio.gather(slow, return_exceptions=True)
            waited = time.monotonic() - t0
            obs, info = await call("after", 0.0)
            return failed[0], waited, obs

    failed, waited, obs = run_async(go(), timeout=120)
    assert isinstance(failed, CallFailed) and "channel to" in str(failed), failed
    assert waited < 2.0, f"the open call waited {waited:.1f}s for an answer that could not come"
    assert "turn 0" in obs  # answered over a new channel


def test_a_batch_task_without_a_channel_fails_at_once(address, run_async):
    """A task pinned to a worker where its caller has no channel would answer into nothing (its calls would
    wait for their timeouts): it fails, naming why."""

    async def go():
        async with Client(address, asynchronous=True) as client:
            cpu = await _env_worker(client)
            Dispatcher(client).close()
            payload = pickle.dumps([dict(_reset("orphan"), _cid=0)])
            fut = client.submit(tasks.run_batch, tasks.env_reset_stream, payload, "no-such-topic", **submit_kwargs("CPU", cpu))
            with pytest.raises(NoChannel, match="no channel for no-such-topic"):
                await fut

    run_async(go(), timeout=120)


def test_a_call_nobody_answers_times_out_on_time(address, run_async):
    async def go():
        async with _dispatcher(address) as (client, cpu, d):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="env-reset on .* gave no answer in 1s"):
                await d.call("env-reset", tasks.env_reset_stream, _reset("late", 4.0), pool="CPU", worker=cpu, timeout=1.0, streamed=True)
            return time.monotonic() - t0, d._deadlines

    took, deadlines = run_async(go(), timeout=120)
    assert 1.0 <= took < 2.5, took
    assert not deadlines  # nothing left in the timer


def _batch_seconds(dask_scheduler, span_id: str) -> dict:
    metrics = dask_scheduler.extensions["spans"].spans[span_id]._cumulative_worker_metrics
    return {k[1]: v for k, v in metrics.items() if k[0] == "execute" and k[2] == "rollart-batch"}


def test_each_batch_shows_in_the_task_stream_and_in_its_span(address, run_async):
    """Batches are no Dask tasks, yet the dashboard shows them: the worker reports each (about once a second)
    and the scheduler files it into the task stream and into the fine performance metrics of its span."""

    async def go():
        async with _dispatcher(address) as (client, cpu, d):
            await client.get_task_stream(start=time.time())  # installs the recorder
            t0 = time.time()
            with span("channels-test") as span_id:
                await client.submit(int, 1, pure=False)  # a span the scheduler knows holds a task
                for name in ("a", "b", "c"):
                    await d.call("env-reset", tasks.env_reset_stream, _reset(name, 0.05), pool="CPU", worker=cpu, timeout=60, streamed=True)
            for _ in range(50):  # reports leave the worker about once a second
                stream = [r for r in await client.get_task_stream(start=t0) if key_split(r["key"]) == "env-reset"]
                seconds = await client.run_on_scheduler(_batch_seconds, span_id=span_id)
                if len(stream) >= 3 and seconds:
                    break
                await asyncio.sleep(0.2)
            return stream, seconds

    stream, seconds = run_async(go(), timeout=120)
    assert len(stream) == 3 and len({r["worker"] for r in stream}) == 1, stream
    for r in stream:
        (ss,) = r["startstops"]
        assert ss["action"] == "compute" and ss["stop"] - ss["start"] >= 0.05  # from the batch's arrival to its last answer
    assert seconds.get("env-reset", 0) >= 0.15, seconds


def test_a_late_report_is_filed_in_stop_order():
    """The task stream is searched by stop time: a batch reported after tasks that ended later goes before them."""
    from collections import deque
    from types import SimpleNamespace

    from rollart_dask.compat import file_in_task_stream

    def rec(stop):
        return {"key": f"k-{stop}", "startstops": ({"action": "compute", "start": stop - 1, "stop": stop},)}

    stream = SimpleNamespace(buffer=deque([rec(1), rec(3), rec(5)], maxlen=4), index=3)
    file_in_task_stream(stream, rec(4))
    file_in_task_stream(stream, rec(6))  # full: the oldest leaves, as on append
    assert [r["startstops"][0]["stop"] for r in stream.buffer] == [3, 4, 5, 6] and stream.index == 5
