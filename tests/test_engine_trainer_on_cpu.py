"""Engine and trainer services directly (no cluster): constrained decoding, log-probs, abort,
and a GRPO step that moves the policy the way the advantages say."""

import math

import pytest
import torch

from rollart_dask.resource.pools import PoolError, PoolMap, submit_kwargs
from rollart_dask.data.engine_torch import TorchEngine
from rollart_dask.data.trainer_torch import TorchTrainer

PROMPT = "SFFF\nFPFH\nFFFH\nHFFG"


@pytest.fixture(scope="module")
def engine(model_dir):
    return TorchEngine(str(model_dir), seed=0)


def req(i, temperature=1.0, choices=("L", "D", "R", "U"), max_tokens=2, prompt=PROMPT):
    return {
        "id": f"r{i}",
        "prompt": prompt,
        "choices": list(choices) if choices else None,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }


def test_constrained_decoding_only_emits_choices_with_normalised_logprobs(engine):
    out = engine.generate([req(i) for i in range(64)])
    assert {c.text for c in out} <= {"L", "D", "R", "U"} and len({c.text for c in out}) > 1
    choice_ids = sorted(i for ch in "LDRU" for i in engine.tokenizer.encode(ch, add_special_tokens=False))
    assert len(choice_ids) == 4  # one token per choice (the character-level tiny model)
    for c in out:
        assert c.finish_reason == "stop" and len(c.token_ids) == 1 and c.version == 0
        # one allowed set per response token, and the first is exactly the choices' ids: what the trainer masks with
        assert len(c.allowed_ids) == len(c.token_ids) and sorted(c.allowed_ids[0]) == choice_ids
        assert c.token_ids[0] in c.allowed_ids[0] and engine.tokenizer.decode(c.token_ids) == c.text
        assert c.logprobs[0] <= 0
    # the four choices' probabilities, recovered from the samples' log-probs, sum to one
    probs = {c.text: math.exp(c.logprobs[0]) for c in out}
    assert len(probs) == 4 and abs(sum(probs.values()) - 1) < 1e-4


def test_multi_token_choices_and_unconstrained_length(engine):
    out = engine.generate(
        [req(0, choices=("left", "down"), max_tokens=8), req(1, choices=None, max_tokens=5), req(2, choices=("left", "down"), max_tokens=2)]
    )
    assert out[0].text in ("left", "down") and out[0].finish_reason == "stop"
    assert out[1].finish_reason in ("length", "stop") and len(out[1].token_ids) <= 5
    assert out[2].finish_reason == "length" and len(out[2].token_ids) == 2  # the token budget wins


def test_greedy_is_deterministic(engine):
    a = engine.generate([req(0, temperature=0)])[0]
    b = engine.generate([req(1, temperature=0)])[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_finished_requests_leave_the_batch_without_changing_anyone_s_tokens(engine):
    """Short, long, constrained and free requests decoded together (rows of finished requests are
    dropped from the KV cache as they finish) give exactly what each gives alone."""
    mixed = [
        req(0, temperature=0, choices=None, max_tokens=24),
        req(1, temperature=0),
        req(2, temperature=0, prompt="FFG\nPHF"),
        req(3, temperature=0, choices=("left", "down", "l"), max_tokens=8),
        req(4, temperature=0, choices=None, max_tokens=3, prompt="x"),
    ]
    together = engine.generate(mixed)
    for r, c in zip(mixed, together):
        alone = engine.generate([dict(r, id=r["id"] + "-alone")])[0]
        assert (c.token_ids, c.finish_reason, c.allowed_ids) == (alone.token_ids, alone.finish_reason, alone.allowed_ids)
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert len(together[0].token_ids) > 3 and len(together[1].token_ids) == 1


def test_abort_before_decoding(engine):
    engine.abort(["r7"])
    out = engine.generate([req(7, choices=None, max_tokens=8), req(8, choices=None, max_tokens=2)])
    assert out[0].finish_reason == "abort" and out[0].token_ids == []
    assert out[1].finish_reason != "abort"


def test_grpo_step_moves_policy_toward_positive_advantage(model_dir, engine):
    trainer = TorchTrainer(str(model_dir), lr=1e-2, entropy_coef=0.0)
    comps = engine.generate([req(i) for i in range(32)])
    good = comps[0].text
    samples = [
        {
            "prompt_ids": c.prompt_ids,
            "response_ids": c.token_ids,
            "logprobs": c.logprobs,
            "allowed_ids": c.allowed_ids,
            "advantage": 1.0 if c.text == good else -1.0,
        }
        for c in comps
    ]
    before = engine.generate([req(100, temperature=0)])[0]
    for _ in range(5):
        stats = trainer.train_step(samples)
    assert stats["version"] == 5 and stats["forward_rows"] == 1  # 32 samples, one shared input
    engine.update_weights(5, trainer.state_dict())
    after = engine.generate([req(101, temperature=0)])[0]
    assert after.version == 5 and after.text == good and before.logprobs != after.logprobs
    engine.update_weights(0, TorchTrainer(str(model_dir), lr=1e-2).state_dict())  # leave the shared engine as it was


def test_trainer_checkpoint_round_trip(model_dir, tmp_path):
    t = TorchTrainer(str(model_dir), lr=1e-3)
    s = {"prompt_ids": [5, 6, 7], "response_ids": [8], "logprobs": [-1.0], "allowed_ids": None, "advantage": 1.0}
    initial = {k: v.clone() for k, v in t.state_dict().items()}
    t.train_step([s, dict(s, advantage=-1.0, response_ids=[9])])
    trained = t.state_dict()
    assert [k for k in initial if not torch.equal(initial[k], trained[k])]  # the step changed weights: a no-op restore would show
    path = t.save_checkpoint(tmp_path / "ck")
    t2 = TorchTrainer(str(model_dir), lr=1e-3)
    assert any(not torch.equal(v, trained[k]) for k, v in t2.state_dict().items())  # a fresh trainer starts from the initial weights
    assert t2.restore(path) == 1
    for k, v in trained.items():
        assert torch.equal(v, t2.state_dict()[k]), k


def test_pool_map_validation_and_submit_kwargs():
    pm = PoolMap(
        {"tcp://a": {"name": "train-0", "resources": {"H800": 1, "TRAIN": 1}}, "tcp://b": {"name": "cpu-0", "resources": {"CPU": 1}}}
    )
    assert pm.engine_workers("H800") == [] and pm.members("H800") == ["tcp://a"]
    with pytest.raises(PoolError) as e:
        pm.validate({"H800": "engine for task x", "SERVERLESS": "reward runner", "CPU": "env hosts"})
    assert (
        "pool H800 (engine for task x) has no worker" in str(e.value)
        and "pool SERVERLESS" in str(e.value)
        and "CPU" not in str(e.value).split("Workers seen")[0]
    )
    kw = submit_kwargs("CPU", worker="tcp://b", key="env-step-1")
    assert kw == {"resources": {"CPU": 1}, "pure": False, "workers": ["tcp://b"], "allow_other_workers": False, "key": "env-step-1"}
    with pytest.raises(PoolError, match="unknown pool 'GPU'"):
        submit_kwargs("GPU")


def test_engine_logprobs_equal_trainer_logprobs_for_multi_token_batches(model_dir, engine):
    """Every decoded token after the first must see the prompt through the KV cache: the
    engine's behaviour log-probs equal the trainer's recomputation (PPO ratio 1 before an
    update) for multi-token, left-padded, deduplicated, constrained and free requests."""
    from rollart_dask.algo.losses import masked_logprobs_and_entropy

    numbers = [str(i) for i in range(-10, 21)]  # '1' is a prefix of '12': it ends with an explicit EOS
    reqs = [req(i, choices=numbers, max_tokens=4, prompt=p) for i, p in enumerate(["Calculate 3 - 5.", "Calculate 10 + 8."] * 8)]
    reqs += [req(100 + i, choices=None, max_tokens=6, prompt="free text") for i in range(4)]
    out = engine.generate(reqs)
    assert {c.text for c in out[:16]} <= set(numbers) and any(len(c.token_ids) > 1 for c in out[:16])
    trainer = TorchTrainer(str(model_dir), lr=1e-3)
    samples = [
        {"prompt_ids": c.prompt_ids, "response_ids": c.token_ids, "logprobs": c.logprobs, "allowed_ids": c.allowed_ids, "advantage": 0.0}
        for c in out
    ]
    for batch in (samples[:16], samples[16:]):
        ids, attn, row, targets, old, mask, allowed, pos_index, _ = trainer._tensors(batch)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=attn).logits[row]
            logits = logits.gather(1, pos_index.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
            logp, _ = masked_logprobs_and_entropy(logits, targets, allowed, 1.0)
        assert torch.allclose(logp[mask], old[mask], atol=1e-4), (logp[mask] - old[mask]).abs().max()


def test_micro_batches_give_the_same_update_as_one_batch(model_dir, engine):
    """Length-sorted micro-batches with token-weighted accumulation are the same token-level loss."""
    prompts = ["SFFF\nFPFH\nFFFH\nHFFG", "Calculate 3 - 5.", "a much longer prompt that pads everyone else " * 3]
    comps = engine.generate([req(i, prompt=prompts[i % 3], choices=None, max_tokens=3) for i in range(24)])
    samples = [
        {"prompt_ids": c.prompt_ids, "response_ids": c.token_ids, "logprobs": c.logprobs, "allowed_ids": None, "advantage": (-1.0) ** i}
        for i, c in enumerate(comps)
    ]
    one = TorchTrainer(str(model_dir), lr=1e-2, micro_batch_tokens=10**9)
    many = TorchTrainer(str(model_dir), lr=1e-2, micro_batch_tokens=64)
    assert len(many.micro_batches(samples)) > 2 and len(one.micro_batches(samples)) == 1
    a, b = one.train_step(samples), many.train_step(samples)
    assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
    for (k, p), q in zip(one.model.named_parameters(), many.model.parameters()):  # gradients (Adam's first step is ~sign(g))
        assert torch.allclose(p.grad, q.grad, atol=1e-6), k


@pytest.mark.parametrize("lora", [False, True])
def test_the_lm_head_on_response_positions_alone_gives_the_whole_forwards_logits(model_dir, engine, lora):
    """The trainer projects only the positions that predict response tokens onto the vocabulary; the logits (and so the
    loss and its gradient) are the whole forward's at those positions, with a LoRA adapter too."""
    from rollart_dask.config import LoraConfig

    trainer = TorchTrainer(str(model_dir), lr=1e-3, lora=LoraConfig(r=4, alpha=8) if lora else None)
    samples = [
        {"prompt_ids": c.prompt_ids, "response_ids": c.token_ids, "logprobs": c.logprobs, "allowed_ids": None, "advantage": 1.0}
        for c in engine.generate([req(i, choices=None, max_tokens=5, prompt=PROMPT[: 8 + 3 * i]) for i in range(4)])
    ]
    ids, attn, row, *_, pos_index, _ = trainer._tensors(samples)
    assert trainer._decoder_and_head()[0] is not None
    fast = trainer._response_logits(ids, attn, row, pos_index)
    whole = trainer._logits(ids, attn)[row]
    whole = whole.gather(1, pos_index.unsqueeze(-1).expand(-1, -1, whole.size(-1)))
    assert fast.shape == whole.shape and torch.allclose(fast, whole, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_a_shared_prompt_run_once_gives_the_same_update(model_dir, engine, lora):
    """trainer.shared_prompt: each distinct prompt runs once and its keys and values serve every sample that shares it
    (a GRPO group): the same logits, loss and gradients as a row per sample, with responses of different lengths, a
    one-token prompt and micro-batches cutting groups apart."""
    from rollart_dask.config import LoraConfig

    prompts = ["SFFF\nFPFH\nFFFH\nHFFG", "Calculate 3 - 5.", "a much longer prompt that pads everyone else " * 3]
    comps = engine.generate([req(i, prompt=prompts[i % 3], choices=None, max_tokens=4) for i in range(12)])
    samples = [
        {
            "prompt_ids": c.prompt_ids,
            "response_ids": c.token_ids[: 1 + i % 4],
            "logprobs": c.logprobs[: 1 + i % 4],
            "allowed_ids": None,
            "advantage": (-1.0) ** i,
        }
        for i, c in enumerate(comps)
    ]  # responses of 1 to 4 tokens
    samples.append({**samples[0], "prompt_ids": samples[0]["prompt_ids"][:1]})  # a prompt of one token
    assert len({len(s["response_ids"]) for s in samples}) > 1
    adapter = LoraConfig(r=4, alpha=8) if lora else None
    for micro in (10**9, 64):
        rows = TorchTrainer(str(model_dir), lr=1e-2, lora=adapter, micro_batch_tokens=micro)
        shared = TorchTrainer(str(model_dir), lr=1e-2, lora=adapter, micro_batch_tokens=micro)
        shared.shared_prompt = True
        mask = rows._tensors(samples)[5]  # (positions past a response's end are padding in both, never trained)
        assert torch.allclose(
            shared._shared_prompt_logits(samples, 4)[mask], rows._response_logits(*_fast_args(rows, samples))[mask], atol=1e-4
        )
        a, b = rows.train_step(samples), shared.train_step(samples)
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4
        for (k, p), q in zip(rows.model.named_parameters(), shared.model.parameters()):
            assert (p.grad is None) == (q.grad is None), k
            assert p.grad is None or torch.allclose(p.grad, q.grad, atol=1e-5), k


def _fast_args(trainer, samples):
    ids, attn, row, *_, pos_index, _ = trainer._tensors(samples)
    return ids, attn, row, pos_index
