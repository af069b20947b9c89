"""Answers of pinned calls travel over the dispatcher's own comm to each worker (data/answers.py), not through
the scheduler: what happens when that comm breaks, when a task finds no channel, and when nothing answers."""
import asyncio
import pickle
import time

import pytest
from distributed import Client

from rollart_dask.control.dispatch import CallFailed, Dispatcher
from rollart_dask.data import plugins, tasks
from rollart_dask.data.answers import NoChannel
from rollart_dask.resource.pools import PoolMap, submit_kwargs


def _reset(name: str, seconds: float = 0.0) -> dict:
    return {"traj_id": name, "env": "synthetic", "env_args": {}, "seed": 1, "member": "0",
            "inject": {"reset_latency": {"dist": "constant", "s": seconds}, "time_scale": 1.0}}


async def _env_worker(client) -> str:
    await client.register_plugin(plugins.EnvHostPlugin(["CPU"]), name=plugins.ENVHOST)
    return PoolMap.from_scheduler_info(await client.scheduler.identity()).members("CPU")[0]


def test_a_broken_channel_fails_its_open_calls_and_the_next_call_opens_a_new_one(address, run_async):
    async def go():
        async with Client(address, asynchronous=True) as client:
            cpu = await _env_worker(client)
            d = Dispatcher(client)
            try:
                call = lambda name, s: d.call("env-reset", tasks.env_reset_stream, _reset(name, s), pool="CPU", worker=cpu,
                                              timeout=60, streamed=True)
                await call("warm", 0.0)  # opens the channel
                slow = asyncio.ensure_future(call("slow", 3.0))
                await asyncio.sleep(0.5)  # its task has started; its answer would come on the channel
                t0 = time.monotonic()
                (await d._channels[cpu]).abort()  # the comm breaks (the worker's side sees it closed)
                failed = await asyncio.gather(slow, return_exceptions=True)
                waited = time.monotonic() - t0
                obs, info = await call("after", 0.0)
                return failed[0], waited, obs
            finally:
                d.close()

    failed, waited, obs = run_async(go(), timeout=120)
    assert isinstance(failed, CallFailed) and "answer channel" in str(failed), failed
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
            with pytest.raises(NoChannel, match="no answer channel"):
                await fut

    run_async(go(), timeout=120)


def test_a_call_nobody_answers_times_out_on_time(address, run_async):
    async def go():
        async with Client(address, asynchronous=True) as client:
            cpu = await _env_worker(client)
            d = Dispatcher(client)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError, match="env-reset on .* gave no answer in 1s"):
                    await d.call("env-reset", tasks.env_reset_stream, _reset("late", 4.0), pool="CPU", worker=cpu, timeout=1.0,
                                 streamed=True)
                return time.monotonic() - t0, d._deadlines
            finally:
                d.close()

    took, deadlines = run_async(go(), timeout=120)
    assert 1.0 <= took < 2.5, took
    assert not deadlines  # nothing left in the timer
