"""Emulated hardware: timing formulas, the continuous-batching engine, the trainer, the ideal."""

import threading
import time

import pytest

from rollart_dask.emulation.engine import ContinuousBatch, EmulatedEngine, Seq
from rollart_dask.emulation.hardware import (
    H20,
    H800,
    QWEN3_8B,
    QWEN3_14B,
    QWEN3_32B,
    decode_step_seconds,
    kv_capacity_tokens,
    prefill_seconds,
    train_step_seconds,
)
from rollart_dask.emulation.ideal import Latency, Pool, Workload
from rollart_dask.emulation.trainer import EmulatedTrainer
from tests.oracles import Cluster, drain, ideal_step

P8 = QWEN3_8B.params


def test_model_profiles_match_the_model_cards():
    assert P8 / 1e9 == pytest.approx(8.2, abs=0.05)
    assert QWEN3_14B.params / 1e9 == pytest.approx(14.8, abs=0.05)
    assert QWEN3_32B.params / 1e9 == pytest.approx(32.8, abs=0.05)
    assert QWEN3_8B.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_prefill_formula_and_h800_is_6_7x_faster():
    t = prefill_seconds(QWEN3_8B, H800, 4096)
    flops = 2 * P8 * 4096 + 4 * 36 * 32 * 128 * 4096 * 2048
    assert t == pytest.approx(flops / (989.5e12 * 0.5))
    assert prefill_seconds(QWEN3_8B, H20, 4096) / t == pytest.approx(989.5 / 148, rel=1e-6)  # ~6.7x
    assert prefill_seconds(QWEN3_8B, H800, 4096, tp=2) == pytest.approx(t / 2)


def test_decode_step_is_bandwidth_bound_and_h20_wins_small_batches():
    ctx = 4 * 2000
    expect = (2 * P8 + QWEN3_8B.kv_bytes_per_token * ctx) / (3.35e12 * 0.7)
    assert decode_step_seconds(QWEN3_8B, H800, 4, ctx) == pytest.approx(expect)
    assert decode_step_seconds(QWEN3_8B, H20, 4, ctx) < decode_step_seconds(QWEN3_8B, H800, 4, ctx)
    # H20's low FLOPs/byte: a large batch turns compute-bound there, and H800 wins again
    assert decode_step_seconds(QWEN3_8B, H20, 512, 512 * 100) > decode_step_seconds(QWEN3_8B, H800, 512, 512 * 100)


def test_kv_capacity_and_train_step():
    assert kv_capacity_tokens(QWEN3_8B, H800) == int((80e9 * 0.9 - 2 * P8) // 147456)
    assert kv_capacity_tokens(QWEN3_32B, H20, tp=2) > kv_capacity_tokens(QWEN3_32B, H20)
    assert train_step_seconds(QWEN3_8B, 8, 1_000_000) == pytest.approx(6 * P8 * 1e6 / (8 * 989.5e12 * 0.4))


def _seq(rid, prompt, out):
    return Seq(rid, list(range(prompt)), out)


def test_continuous_batching_beats_serial_and_short_requests_leave_early():
    alone = ContinuousBatch(QWEN3_8B, H20)
    alone.submit(_seq("x", 1000, 200))
    drain(alone)
    together = ContinuousBatch(QWEN3_8B, H20)
    seqs = [Seq(f"r{i}", [i] * 1000, 200) for i in range(16)]
    long = Seq("long", [99] * 1000, 2000)
    for s in seqs + [long]:
        together.submit(s)
    drain(together)
    assert max(s.t_done for s in seqs) < 4 * alone.clock < 16 * alone.clock
    # the long one does not hold the short ones back: they end as if all 17 were short
    same = ContinuousBatch(QWEN3_8B, H20)
    for i in range(17):
        same.submit(Seq(f"s{i}", [i] * 1000, 200))
    drain(same)
    assert max(s.t_done for s in seqs) == pytest.approx(same.clock)
    assert long.t_done > 2 * same.clock


def test_kv_capacity_limits_concurrency_and_prefix_cache_skips_prefill():
    b = ContinuousBatch(QWEN3_8B, H800, kv_tokens=3 * 1100)
    for i in range(6):
        b.submit(Seq(f"r{i}", [i] * 1000, 100))
    drain(b)
    assert b.counters["max_batch"] == 3 and b.kv_used == 0
    b2 = ContinuousBatch(QWEN3_8B, H800)
    b2.submit(Seq("a", list(range(1600)), 2))
    drain(b2)
    t0 = b2.clock
    b2.submit(Seq("b", list(range(1600)) + [7] * 16, 2))  # same prefix: only the tail is prefilled
    drain(b2)
    assert b2.counters["cached_tokens"] == 1600 and b2.clock - t0 < t0 / 3 and b2.counters["prefill_tokens"] == 1600 + 16


def test_engine_contract_choices_version_and_abort():
    eng = EmulatedEngine(QWEN3_8B, H800, time_scale=1e-3, seed=1)
    assert EmulatedEngine.label == "emulated"
    reqs = [{"id": f"t{i}#0", "prompt": "state", "choices": ["Left", "Right"], "max_tokens": 2, "temperature": 1.0} for i in range(8)]
    out = eng.generate(reqs)
    assert {c.text for c in out} <= {"Left", "Right"} and all(c.version == 0 and c.finish_reason == "stop" for c in out)
    assert eng.generate(reqs)[0].text == out[0].text  # deterministic from seed and id
    assert eng.update_weights(3, {}) == 3 and eng.generate(reqs[:1])[0].version == 3
    assert eng.stats["requests"] == 17 and eng.stats["tokens"] > 0 and eng.stats["busy_s"] > 0

    # At time_scale 1 the request would take minutes of wall time: the abort comes first however late a loaded
    # machine wakes this thread (an abort that comes before its request ends that request at once, as aborted).
    slow, res = EmulatedEngine(QWEN3_8B, H800, time_scale=1.0, seed=1), {}
    th = threading.Thread(target=lambda: res.update(c=slow.generate([{"id": "slow#1", "prompt": "p", "max_tokens": 100_000}])))
    th.start()
    time.sleep(0.2)
    slow.abort(["slow#1"])
    th.join(timeout=30)
    cut = res["c"][0]  # what it generated before the abort (a continuation goes on from it), far from the whole
    assert cut.finish_reason == "abort" and len(cut.token_ids) < 100_000 and len(cut.logprobs) == len(cut.token_ids)


def test_engine_time_scale_scales_wall_time_and_joins_concurrent_calls():
    """The model's time is exact; the wall clock is only bounded from below (a sleep never ends early) and,
    generously, from above (a busy 2-core machine may wake a thread late by a good fraction of a second)."""
    slack_s = 2.0  # wake-up latency allowed on a loaded machine; the unscaled time here would be ~3 s per call
    req = {"id": "t#0", "prompt": "x", "max_tokens": 8, "emulate": {"prompt_tokens": 2000, "output_tokens": 500}}
    emulated = {}
    for scale in (0.01, 0.03):
        eng = EmulatedEngine(QWEN3_8B, H20, time_scale=scale)
        t0 = time.perf_counter()
        eng.generate([req])
        wall = time.perf_counter() - t0
        emulated[scale] = eng.stats["emulated_busy_s"]
        assert eng.stats["busy_s"] == pytest.approx(emulated[scale] * scale)
        assert 0.99 * emulated[scale] * scale <= wall < emulated[scale] * scale + slack_s, (scale, wall, emulated[scale])
    assert emulated[0.01] == pytest.approx(emulated[0.03], rel=0.05)  # the modelled time does not depend on the scale
    # two callers at once share the batch (max_batch 2): together about the modelled time of one, not two
    eng = EmulatedEngine(QWEN3_8B, H20, time_scale=0.03)
    ths = [threading.Thread(target=eng.generate, args=([{**req, "id": f"c{i}#0"}],)) for i in range(2)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    wall = time.perf_counter() - t0
    assert eng.stats["max_batch"] == 2
    assert eng.stats["emulated_busy_s"] < 1.9 * emulated[0.03], (eng.stats["emulated_busy_s"], emulated[0.03])  # serial would be 2×
    assert 0.99 * eng.stats["busy_s"] <= wall < eng.stats["busy_s"] + slack_s


def test_trainer_step_time_scales_with_tokens(tmp_path):
    tr = EmulatedTrainer(QWEN3_8B, gpus=8, time_scale=1e-3)
    small = [{"prompt_ids": [0] * 1000, "response_ids": [0] * 24}] * 64
    m1, m2 = tr.train_step(small), tr.train_step(small * 4)
    assert m2["emulated_train_s"] == pytest.approx(4 * m1["emulated_train_s"]) and m2["version"] == 2
    assert m1["emulated_train_s"] == pytest.approx(train_step_seconds(QWEN3_8B, 8, 64 * 1024))
    assert tr.state_dict() == {"emulated.version": 2}
    tr.save_checkpoint(tmp_path / "ck")
    assert EmulatedTrainer().restore(tmp_path / "ck") == 2


def test_ideal_bounds_on_a_hand_checkable_workload():
    # generation made negligible (1-token prompts and outputs): the env and train terms decide
    w = Workload(trajectories=4, turns=2, prompt_tokens=1, output_tokens=1, env_step=10.0, env_reset=0.0)
    c = Cluster(QWEN3_8B, (Pool(H800, 1),), train_gpus=1, update_s=1.0)
    gen = ideal_step(w, c, "sync").terms["generation_latency_s"]
    sync = ideal_step(w, c, "sync")
    train = sync.terms["train_s"]
    assert train == pytest.approx(6 * P8 * 4 * (2 + 3) / (989.5e12 * 0.4))
    assert sync.step_s == pytest.approx(gen + 20 + 1 + train)
    assert ideal_step(w, c, "one_off").step_s == pytest.approx(max(gen + 20, train) + 1)
    r1 = ideal_step(w, c, "rollart", alpha=1)
    assert r1.step_s == pytest.approx((gen + 20) / 2) and r1.binding == "latency/(alpha+1)"
    assert ideal_step(w, c, "rollart", alpha=3).step_s == pytest.approx((gen + 20) / 4)
    # heavy tails: the batch-level barrier costs more than trajectory level
    wt = Workload(64, 4, 1, 1, env_step=Latency(1.0, sigma=1.5, cap=100))
    bl = ideal_step(wt, c, "rollart", alpha=0, level="batch").step_s
    tl = ideal_step(wt, c, "rollart", alpha=0, level="trajectory").step_s
    assert bl > 1.2 * tl
    assert sync.fraction(2 * sync.step_s) == pytest.approx(0.5)
