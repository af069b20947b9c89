"""Aborts that reach an engine before their request. An abort and its generate are separate Dask tasks,
so the abort can come first; the request must then end at once (finish "abort") rather than run to its
end — Suspend waits for every aborted request, up to generate_timeout_s."""

import threading
import time

import torch

from rollart_dask.config import EmulationConfig, EngineConfig
from rollart_dask.data.backends import ENGINES
from rollart_dask.data.engine_base import RecentAborts
from tests.conftest import wait_for


def request(rid: str, **kw) -> dict:
    return {"id": rid, "prompt": "go", "choices": None, "max_tokens": 8, "temperature": 1.0, **kw}


def test_torch_engine_ends_a_request_whose_abort_came_first(model_dir):
    threads = torch.get_num_threads()
    try:
        engine = ENGINES.get("torch").from_config(EngineConfig(), model_dir=str(model_dir), seed=0)
    finally:
        torch.set_num_threads(threads)
    engine.abort(["t1#early"])
    early, other = engine.generate([request("t1#early"), request("t2#other")])
    assert early.finish_reason == "abort" and early.token_ids == []
    assert other.finish_reason != "abort" and other.token_ids
    assert "t1#early" not in engine._aborted  # consumed by its request, not kept


def test_emulated_engine_ends_a_request_whose_abort_came_while_it_was_busy():
    """The emulated engine applied aborts to what its batch held and forgot the rest: an abort that came
    while it decoded other requests, before its own request, was lost and the request ran to its end."""
    engine = ENGINES.get("emulated").from_config(
        EngineConfig(),
        model_dir="",
        pool="H20",
        emulation=EmulationConfig(time_scale=0.05, pools={"H20": {"gpu": "H20", "gpus": 1, "tp": 1}}),
    )
    long = request("busy#1", max_tokens=100_000, emulate={"prompt_tokens": 64, "output_tokens": 20_000})
    done: list = []
    runner = threading.Thread(target=lambda: done.extend(engine.generate([long])), daemon=True)
    runner.start()
    (instance,) = engine.engines
    wait_for(lambda: "busy#1" in instance.batch.running, timeout=30, what="the driver decoding the long request")
    engine.abort(["late#1"])
    wait_for(lambda: not instance._fresh_aborts, timeout=30, what="the driver going through its aborts")
    t0 = time.monotonic()
    (late,) = engine.generate([request("late#1", max_tokens=2_000, emulate={"prompt_tokens": 64, "output_tokens": 2_000})])
    took = time.monotonic() - t0
    engine.abort(["busy#1"])
    runner.join(30)
    assert late.finish_reason == "abort" and len(late.token_ids) == 0, late.finish_reason
    assert done and done[0].finish_reason == "abort"
    assert took < 5, f"the aborted request took {took:.1f} s"


def test_recent_aborts_forget_ids_after_their_time():
    aborts = RecentAborts(ttl_s=3600)
    aborts.update(["a", "b"])
    aborts.discard("a")
    assert "a" not in aborts and "b" in aborts and len(aborts) == 1
    expiring = RecentAborts(ttl_s=0.0)  # every id is already old at the next abort
    expiring.update(["x"])
    expiring.update(["y"])
    assert "x" not in expiring
