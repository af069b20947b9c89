"""The megatron-core trainer backend on CPU: HF ↔ Megatron weight conversion (exact both ways, and
the same logits as the HF model), one GRPO step through MegatronTrainer (the same loss value as the
torch trainer), HF checkpoints, the flow's validation errors, and a short flow run.

megatron-core is a GPU library; on this CPU-only torch it runs inside ``cpu_redirect()``. Megatron's
own optimizer and pipeline schedules need CUDA: deploy/gpu/check_megatron.py covers them on a GPU.
"""

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed (pip install -e '.[megatron]')"
)

from rollart_dask.config import FlowError, load_flow
from rollart_dask.data import trainer_megatron as tm
from tests.conftest import flow_dict

PROMPT = "SFFF\nFPFH\nFFFH\nHFFG\n"


def _hf_pair(kind: str):
    """A tiny HF model built locally, every weight random (biases and norms too, so a misplaced one shows)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
        vocab_size=99,
        max_position_embeddings=64,
    )
    if kind == "qwen2":  # tied embeddings, q/k/v bias, GQA
        config, cls = Qwen2Config(**common, tie_word_embeddings=True), Qwen2ForCausalLM
    else:  # Llama / SmolLM2 family: untied, no bias, another RoPE base
        config, cls = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=100000.0), LlamaForCausalLM
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return config, model


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_hf_megatron_round_trip_is_exact(kind, model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config, model = _hf_pair(kind)
    cases = [(config, model.state_dict())]
    if kind == "qwen2":  # and the project's own tiny model (Qwen2, multi-head, tied)
        cases.append((AutoConfig.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).state_dict()))
    for cfg, hf in cases:
        meg = tm.hf_to_megatron(hf, cfg)
        back = tm.megatron_to_hf(meg, cfg)
        assert back.keys() == hf.keys()
        assert all(torch.equal(back[k], hf[k]) for k in hf)
        assert torch.equal(
            tm.hf_to_megatron(back, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"],
            meg["decoder.layers.0.self_attention.linear_qkv.weight"],
        )
    # tensor/pipeline shards put back together give the full state dict (vocab padded to a multiple of tp)
    for tp, pp in [(2, 1), (1, 2), (2, 2)]:
        full = tm.hf_to_megatron(model.state_dict(), config, tp)
        shards = {(r, s): tm.shard_megatron(full, config, tp, pp, r, s) for r in range(tp) for s in range(pp)}
        assert shards[(0, 0)]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96 // tp, 64)
        joined = tm.unshard_megatron(shards, config, tp, pp)
        assert joined.keys() == full.keys() and all(torch.equal(joined[k], full[k]) for k in full)
        assert tm.megatron_to_hf(joined, config).keys() == model.state_dict().keys()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_megatron_gpt_logits_match_the_hf_model(kind):
    """Not only invertible: the converted GPTModel computes what the HF model computes."""
    config, model = _hf_pair(kind)
    tm.init_parallel(1, 1, seed=0)
    gpt = tm.build_gpt(config)
    meg = tm.hf_to_megatron(model.state_dict(), config)
    tm.load_megatron_weights(gpt, meg)
    assert {k for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)} == set(meg)
    gpt.eval()
    ids = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = tm.gpt_logits(gpt, ids, config.vocab_size)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def _samples(tokenizer, n=8):
    """Per-turn samples as the runtime sends them: one action token out of four, advantages of both signs."""
    actions = [tokenizer.convert_tokens_to_ids(c) for c in "LDRU"]
    prompt = tokenizer.encode(PROMPT)
    out = []
    for i in range(n):
        extra = tokenizer.encode("F" * (i % 3))  # a few prompt lengths: padding and micro-batch sorting are exercised
        out.append(
            {
                "prompt_ids": prompt + extra,
                "response_ids": [actions[i % 4]],
                "logprobs": [math.log(0.25)],
                "allowed_ids": [actions],
                "advantage": 1.0 if i % 2 else -1.0,
            }
        )
    return out


@pytest.fixture(scope="module")
def trainer(model_dir):
    return tm.MegatronTrainer(str(model_dir), lr=1e-2, seed=0)


def test_grpo_step_same_loss_as_torch_trainer_and_weights_change(trainer, model_dir):
    from rollart_dask.data.trainer_torch import TorchTrainer

    samples = _samples(trainer.tokenizer)
    before = trainer.state_dict()
    reference = TorchTrainer(str(model_dir), lr=1e-2, seed=0)
    assert before.keys() == reference.state_dict().keys()  # engines and the weight store see the same names
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())
    want = reference.train_step(samples)
    got = trainer.train_step(samples)
    assert math.isfinite(got["loss"]) and got["version"] == 1
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    after = trainer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed
    assert torch.equal(after["lm_head.weight"], after["model.embed_tokens.weight"])  # still tied


def test_sft_step_and_hf_checkpoint_round_trip(trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    stats = trainer.sft_step(_samples(trainer.tokenizer, 4))
    assert math.isfinite(stats["nll"])
    weights = trainer.state_dict()
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    from safetensors.torch import load_file

    saved, initial = load_file(f"{path}/model.safetensors"), load_file(f"{trainer.model_dir}/model.safetensors")
    assert saved.keys() == initial.keys()  # the same files HF (and the torch trainer) write: one tensor for tied weights
    assert [k for k in initial if not torch.equal(saved[k], initial[k])]  # the trained weights were saved, not the initial ones
    hf = AutoModelForCausalLM.from_pretrained(path).state_dict()  # what an engine loads
    assert all(torch.equal(hf[k], weights[k]) for k in weights)
    version = trainer.version
    trainer.train_step(_samples(trainer.tokenizer))
    moved = trainer.state_dict()
    assert [k for k in weights if not torch.equal(moved[k], weights[k])]  # the step moved them: a restore that loads nothing would show
    assert trainer.restore(path) == version
    restored = trainer.state_dict()
    assert all(torch.equal(restored[k], weights[k]) for k in weights)


def test_unsupported_models_and_layouts_are_clear_errors():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, qwen2"):
        tm.check_hf_config(GPT2Config())
    llama = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"tp=4 must divide the attention heads \(4\) and the KV heads \(2\)"):
        tm.check_hf_config(LlamaConfig(**llama), tp=4)
    with pytest.raises(ValueError, match=r"pp=3 must divide the layers \(2\)"):
        tm.check_hf_config(LlamaConfig(**llama), pp=3)
    scaled = LlamaConfig(
        **llama,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    )
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        tm.check_hf_config(scaled)


def test_flow_validation_of_the_megatron_backend(monkeypatch):
    ok = load_flow(data=flow_dict(**{"trainer.backend": "megatron"}))
    assert (ok.trainer.megatron.tp, ok.trainer.megatron.pp) == (1, 1)
    with pytest.raises(FlowError, match=r"trainer.megatron.tp \(3\) must divide model.heads \(2\)"):
        load_flow(data=flow_dict(**{"trainer.backend": "megatron", "trainer.megatron": {"tp": 3}}))
    with pytest.raises(FlowError, match=r"trainer.megatron.pp \(2\) must divide model.layers \(1\)"):
        load_flow(data=flow_dict(**{"trainer.backend": "megatron", "trainer.megatron": {"pp": 2}}))
    with pytest.raises(FlowError, match="needs 2 ranks, but the trainer runs in one Dask worker process"):
        load_flow(data=flow_dict(**{"trainer.backend": "megatron", "trainer.megatron": {"tp": 2}}))
    with pytest.raises(FlowError, match="trainer.megatron.tpp: unknown key"):
        load_flow(data=flow_dict(**{"trainer.backend": "megatron", "trainer.megatron": {"tpp": 2}}))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron.core" else real(name, *a))
    with pytest.raises(FlowError, match=r"megatron-core, which is not installed here: pip install -e '.\[megatron\]'"):
        load_flow(data=flow_dict(**{"trainer.backend": "megatron"}))


@pytest.mark.slow
def test_a_flow_trains_with_the_megatron_backend(tmp_path, model_dir, run_async):
    """trainer.backend=megatron through the whole runtime: the TRAIN worker builds MegatronTrainer, engines
    pull its weights (HF names) after each step, and the checkpoint is an HF directory."""
    from safetensors.torch import load_file

    from tests.conftest import close, start_run

    data = flow_dict(**{"trainer.backend": "megatron"})
    data["cluster"]["workers"] = [  # the fewest workers a run needs: start-up dominates this test
        {"name": "train-0", "pools": ["TRAIN"], "nthreads": 1},
        {"name": "h800-0", "pools": ["H800"], "nthreads": 1},
        {"name": "cpu-0", "pools": ["CPU"], "nthreads": 2},
        {"name": "reward-0", "pools": ["SERVERLESS", "REWARD"], "nthreads": 1},
    ]
    cfg = load_flow(data=data)

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            return await run.run()
        finally:
            await close(run, client, cluster)

    result = run_async(go())
    assert result["steps"] == 2 and result["last"]["version"] == 2
    trained = load_file(f"{result['checkpoint']}/model.safetensors")
    initial = load_file(f"{model_dir}/model.safetensors")
    assert trained.keys() == initial.keys()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
