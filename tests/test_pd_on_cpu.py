"""Prefill/decode disaggregation without a cluster: the torch engine's prefill on one engine and
decode on another give the tokens of the plain engine; version mismatch; config errors; and the
emulated engine's modelled PD times against the formula."""

import pickle

import pytest
import torch

from rollart_dask.data.engine_torch import TorchEngine
from rollart_dask.data.kv import PrefillHandle, StaleKVError

PROMPTS = ["SFFF\nFPFH\nFFFH\nHFFG", "FG\nPH", "x", "SFFFFF\nFFFFFF\nFFHFFF\nFFFPFF\nFFFFFF\nFFFFFG", "FFG\nPHF"]


@pytest.fixture(scope="module")
def engines(model_dir):
    """Three engines on the same weights: plain, prefill (A), decode (B)."""
    return TorchEngine(str(model_dir), seed=0), TorchEngine(str(model_dir), seed=1), TorchEngine(str(model_dir), seed=2)


def batch(tag, choices=None, max_tokens=12, temperature=0.0):
    return [
        {
            "id": f"{tag}{i}",
            "prompt": p,
            "choices": list(choices) if choices else None,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        for i, p in enumerate(PROMPTS)
    ]


def shipped(handles):
    """As Dask moves them between workers: pickled and unpickled."""
    return pickle.loads(pickle.dumps(handles))


def assert_same(plain, pd):
    assert len(plain) == len(pd)
    for a, b in zip(plain, pd):
        assert (a.token_ids, a.finish_reason, a.allowed_ids, a.prompt_ids, a.text, a.version) == (
            b.token_ids,
            b.finish_reason,
            b.allowed_ids,
            b.prompt_ids,
            b.text,
            b.version,
        )
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_pd_greedy_matches_plain_generate_for_different_length_prompts(engines):
    plain, a, b = engines
    reference = plain.generate(batch("p"))
    assert any(len(c.token_ids) > 2 for c in reference)
    handles = a.prefill(batch("p"))
    assert all(isinstance(h, PrefillHandle) and h.version == 0 for h in handles)
    live = [h for h in handles if h.finish is None]
    assert live, "some request must go on decoding after its first token"
    for h in live:  # the prompt's KV per layer, no padding, plain CPU tensors
        assert h.positions == len(h.prompt_ids) and len(h.kv) == a.model.config.num_hidden_layers
        k, v = h.kv[0]
        assert k.device.type == "cpu" and k.shape[-2] == len(h.prompt_ids) and v.shape == k.shape
        assert h.kv_bytes == sum(k.numel() * 4 * 2 for k, _ in h.kv)
    assert a.stats["pd_kv_bytes_out"] == sum(h.kv_bytes for h in handles) > 0
    out = b.decode_from_prefill(shipped(handles))
    assert_same(reference, out)
    assert b.stats["pd_kv_bytes_in"] == a.stats["pd_kv_bytes_out"] and b.stats["pd_decode_requests"] == len(PROMPTS)
    assert b.stats["pd_reprefilled"] == 0


def test_pd_matches_plain_with_choices_constrained_decoding(engines):
    plain, a, b = engines
    choices = ("left", "down", "l", "right", "up")  # multi-token choices, one a prefix of another
    reqs = batch("c", choices=choices, max_tokens=8)
    reference = plain.generate(reqs)
    assert {c.text for c in reference} <= set(choices)
    out = b.decode_from_prefill(shipped(a.prefill(reqs)))
    assert_same(reference, out)
    # single-token choices end at prefill: nothing is shipped, the decode engine only hands them back
    one = batch("o", choices=("L", "D", "R", "U"), max_tokens=2)
    handles = a.prefill(one)
    assert all(h.finish == "stop" and h.kv is None and h.kv_bytes == 0 for h in handles)
    assert_same(plain.generate(one), b.decode_from_prefill(shipped(handles)))


def test_pd_mixed_batch_and_identical_prompts(engines):
    """Identical prompts are prefilled once and fanned out; each still gets its own shipped cache."""
    plain, a, b = engines
    reqs = batch("m") + [dict(r, id=r["id"] + "-dup") for r in batch("m")] + batch("k", choices=("left", "down"), max_tokens=8)
    reference = plain.generate(reqs)
    handles = a.prefill(reqs)
    out = b.decode_from_prefill(shipped(handles))
    assert_same(reference, out)
    # decoding handles from several prefill calls together (another batch on B) changes nothing
    h1, h2 = a.prefill(batch("s1")), a.prefill(batch("s2", choices=("left", "down"), max_tokens=8))
    assert_same(
        plain.generate(batch("s1")) + plain.generate(batch("s2", choices=("left", "down"), max_tokens=8)),
        b.decode_from_prefill(shipped(h1 + h2)),
    )


def test_pd_sampled_decoding_keeps_logprobs_consistent(engines):
    """Sampled: tokens differ by generator, but each log-prob is the decode engine's own distribution."""
    _, a, b = engines
    reqs = batch("t", max_tokens=6, temperature=1.0)
    handles = a.prefill(reqs)
    out = b.decode_from_prefill(shipped(handles))
    for h, c in zip(handles, out):
        assert c.token_ids[: len(h.token_ids)] == h.token_ids and c.logprobs[0] == pytest.approx(h.logprobs[0])
        assert all(lp <= 0 for lp in c.logprobs) and c.finish_reason in ("stop", "length")


def test_version_mismatch_reprefills_or_errors(engines, model_dir):
    plain, a, _ = engines
    b = TorchEngine(str(model_dir), seed=3)
    handles = a.prefill(batch("v"))
    weights = {k: v.clone() for k, v in b.model.state_dict().items()}
    with torch.no_grad():  # version 1: other weights
        weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    b.update_weights(1, weights)
    with pytest.raises(StaleKVError, match="version 0.*version 1"):
        b.decode_from_prefill(shipped(handles), stale="error")
    out = b.decode_from_prefill(shipped(handles))  # default: re-prefilled here under version 1
    live = [i for i, h in enumerate(handles) if h.finish is None]
    assert b.stats["pd_reprefilled"] == len(live)
    again = b.generate([dict(r, id=r["id"] + "-v1") for r in batch("v")])
    for i in live:
        assert out[i].version == 1 and out[i].token_ids == again[i].token_ids
        assert out[i].logprobs == pytest.approx(again[i].logprobs, abs=1e-4)
    # fresh (version 1, prefilled by b itself) and stale handles decoded in one call
    mixed = b.prefill(batch("w")) + a.prefill(batch("u"))
    out = b.decode_from_prefill(shipped(mixed))
    assert all(c.version == 1 for c in out)
    assert_same(b.generate(batch("w") + batch("u")), out)


def test_abort_in_either_phase(engines):
    _, a, b = engines
    reqs = batch("x")
    a.abort(["x0"])
    handles = a.prefill(reqs)
    assert handles[0].finish == "abort" and handles[0].kv is None and handles[0].token_ids == []
    b.abort(["x1"])
    out = b.decode_from_prefill(shipped(handles))
    assert out[0].finish_reason == "abort" and out[1].finish_reason == "abort"
    assert out[0].token_ids == [] and out[1].token_ids == handles[1].token_ids  # what each generated: x1 only the prefill's token
    assert all(c.finish_reason != "abort" for c in out[2:])
    assert "x1" not in b._aborted and "x0" not in a._aborted
    # an abort that reaches the prefill engine after it handed the request on leaves nothing behind there
    a.abort(["x2", "never-seen"])
    assert "x2" not in a._aborted and "never-seen" in a._aborted


# -- config ---------------------------------------------------------------------------------------------
def _flow(**over):
    from rollart_dask.config import load_flow
    from tests.conftest import flow_dict

    return load_flow(data=flow_dict(**over))


def test_pd_config_off_by_default_and_validated():
    from rollart_dask.config import FlowError

    assert _flow().rollout.pd is None
    cfg = _flow(**{"rollout.pd": {"prefill": "H800", "decode": "H20"}})
    assert (cfg.rollout.pd.prefill, cfg.rollout.pd.decode) == ("H800", "H20")
    with pytest.raises(FlowError, match="prefill and decode must be different engine pools"):
        _flow(**{"rollout.pd": {"prefill": "H20", "decode": "H20"}})
    with pytest.raises(FlowError, match=r"rollout\.pd\.prefill: bad value 'CPU'.*'h800' or 'h20'"):
        _flow(**{"rollout.pd": {"prefill": "CPU", "decode": "H20"}})
    with pytest.raises(FlowError, match=r"rollout\.pd\.decode: Field required"):
        _flow(**{"rollout.pd": {"prefill": "H800"}})
    with pytest.raises(FlowError, match=r"rollout\.pd\.kv: unknown key \(allowed: decode, prefill\)"):
        _flow(**{"rollout.pd": {"prefill": "H800", "decode": "H20", "kv": 1}})


def test_pd_needs_an_engine_worker_in_both_pools():
    from rollart_dask.config import FlowError, load_flow
    from rollart_dask.resource.check import engine_pools, needed_pools
    from rollart_dask.resource.pools import PoolMap
    from tests.conftest import flow_dict

    data = flow_dict(**{"rollout.pd": {"prefill": "H800", "decode": "H20"}})
    data["cluster"]["workers"] = [w for w in data["cluster"]["workers"] if w["name"] != "h20-0"]
    with pytest.raises(FlowError, match=r"rollout\.pd\.decode: pool H20 has no engine worker"):
        load_flow(data=data)
    cfg = _flow(**{"rollout.pd": {"prefill": "H800", "decode": "H20"}})  # the task's affinity is prefill (H800) only
    assert engine_pools(cfg, PoolMap()) == ["H20", "H800"]
    assert needed_pools(cfg)["H20"] == "engine for rollout.pd.decode"


def test_pd_with_vllm_is_refused_at_load_and_at_launch(monkeypatch):
    from rollart_dask.config import FlowError, PDNotSupported, check_pd_backend

    with pytest.raises(FlowError, match="prefill/decode disaggregation is not supported by this engine .*use engine.backend torch"):
        _flow(**{"rollout.pd": {"prefill": "H800", "decode": "H20"}, "engine.backend": "vllm"})
    with pytest.raises(PDNotSupported, match=r"rollout\.pd: prefill/decode disaggregation is not supported by this engine"):
        check_pd_backend("vllm")  # engine.backend auto that resolves to vllm, at launch
    check_pd_backend("torch")
    check_pd_backend("emulated")


def test_pd_launch_refuses_auto_resolving_to_vllm_before_touching_the_cluster(monkeypatch, tmp_path):
    import asyncio

    from rollart_dask.config import PDNotSupported
    from rollart_dask.control import wiring
    from rollart_dask.control.run import Run

    class NoCluster:  # the check comes first: nothing of the cluster is asked
        def subscribe_topic(self, *a):
            pass

        def __getattr__(self, name):
            raise AssertionError(f"the cluster was used ({name}) before the engine check")

    monkeypatch.setattr(wiring, "resolve_engine_backend", lambda engine: "vllm")
    run = Run(_flow(**{"rollout.pd": {"prefill": "H800", "decode": "H20"}, "engine.backend": "auto"}), NoCluster(), tmp_path, tmp_path)
    with pytest.raises(PDNotSupported, match="not supported by this engine.*use engine.backend torch"):
        asyncio.run(run.setup())
    run.metrics.close()


# -- emulated engine: modelled PD times --------------------------------------------------------------------
def test_emulated_pd_times_follow_the_formula():
    from rollart_dask.emulation.engine import ContinuousBatch, EmulatedEngine, Seq
    from rollart_dask.emulation.hardware import (
        H20,
        H800,
        QWEN3_8B,
        decode_step_seconds,
        kv_transfer_seconds,
        prefill_seconds,
    )

    from tests.oracles import drain, pd_request_seconds

    prompt, output, link = 3000, 200, 25.0
    f = pd_request_seconds(QWEN3_8B, H800, H20, prompt, output, link)
    # the formula's parts
    assert f["prefill_s"] == pytest.approx(prefill_seconds(QWEN3_8B, H800, prompt))
    assert f["transfer_s"] == pytest.approx(QWEN3_8B.kv_bytes_per_token * prompt / (link * 1e9))  # 144 KiB per token for Qwen3-8B
    assert QWEN3_8B.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    assert f["decode_s"] == pytest.approx(sum(decode_step_seconds(QWEN3_8B, H20, 1, prompt + 1 + k) for k in range(output - 1)))
    # the batch model: prefill on an H800 instance, decode on an H20 instance holding the imported KV
    pre, dec = ContinuousBatch(QWEN3_8B, H800), ContinuousBatch(QWEN3_8B, H20)
    pre.submit(Seq("r", list(range(prompt)), output_tokens=1))
    drain(pre)
    dec.submit(Seq("r", list(range(prompt)), output_tokens=output, kv_imported=True))
    drain(dec)
    assert pre.clock == pytest.approx(f["prefill_s"]) and dec.clock == pytest.approx(f["decode_s"])
    assert dec.counters["prefill_tokens"] == 0 and dec.counters["imported_tokens"] == prompt
    # the engines, as the runtime drives them (time_scale 0: no sleeping, the batch clocks are the emulated time)
    a = EmulatedEngine(QWEN3_8B, H800, time_scale=0)
    b = EmulatedEngine(QWEN3_8B, H20, time_scale=0, kv_link_gbps=link)
    req = {"id": "t0#1", "prompt": "", "max_tokens": output, "emulate": {"prompt_tokens": prompt, "output_tokens": output}}
    (h,) = a.prefill([req])
    assert h.finish is None and h.kv_bytes == QWEN3_8B.kv_bytes_per_token * prompt and h.positions == prompt
    assert h.emulated["prefill_s"] == pytest.approx(f["prefill_s"]) and a.batch.clock == pytest.approx(f["prefill_s"])
    (c,) = b.decode_from_prefill([h])
    assert c.finish_reason == "length" and len(c.token_ids) == output
    assert b.batch.clock == pytest.approx(f["decode_s"]) and b.stats["pd_emulated_kv_transfer_s"] == pytest.approx(
        kv_transfer_seconds(QWEN3_8B, prompt, link)
    )
    assert b.stats["pd_kv_bytes_in"] == a.stats["pd_kv_bytes_out"] == h.kv_bytes
    assert b.stats["pd_emulated_decode_s"] == pytest.approx(f["decode_s"])
    # the same request on one H800 engine without disaggregation costs prefill + decode on H800
    alone = EmulatedEngine(QWEN3_8B, H800, time_scale=0)
    alone.generate([dict(req, id="t1#1")])
    assert alone.batch.clock == pytest.approx(
        f["prefill_s"] + sum(decode_step_seconds(QWEN3_8B, H800, 1, prompt + 1 + k) for k in range(output - 1))
    )


def test_emulated_pd_versions_and_single_token_requests():
    from rollart_dask.emulation.engine import EmulatedInstances
    from rollart_dask.emulation.hardware import H20, H800, QWEN3_8B

    a = EmulatedInstances(2, model=QWEN3_8B, gpu=H800, time_scale=0)
    b = EmulatedInstances(2, model=QWEN3_8B, gpu=H20, time_scale=0)
    reqs = [{"id": f"t{i}#1", "prompt": "x" * 400, "choices": ["up", "down"], "max_tokens": 4, "temperature": 1.0} for i in range(3)]
    reqs.append({"id": "t9#1", "prompt": "y" * 800, "max_tokens": 8, "temperature": 1.0})
    handles = a.prefill(reqs)
    assert [h.finish for h in handles] == ["stop"] * 3 + [None] and handles[0].kv_bytes == 0  # one-token choices end at prefill
    out = b.decode_from_prefill(handles)
    assert [c.text in ("up", "down") for c in out[:3]] == [True] * 3 and len(out[3].token_ids) == 8
    b.update_weights(1)
    h2 = a.prefill([dict(reqs[3], id="t9#2")])
    with pytest.raises(StaleKVError):
        b.decode_from_prefill(h2, stale="error")
    (c,) = b.decode_from_prefill(h2)
    assert c.version == 1 and b.stats["pd_reprefilled"] == 1
