"""LoRA (trainer.lora): the trainer trains and publishes the adapter alone, engines swap it in place on their
base, checkpoints are peft adapters, and `rollart merge` folds one into a full model."""

import json

import pytest
import torch
from click.testing import CliRunner

from rollart_dask.config import LoraConfig, load_flow
from rollart_dask.data.engine_torch import TorchEngine
from rollart_dask.data.trainer_torch import TorchTrainer

from conftest import flow_dict

LORA = LoraConfig(r=4, alpha=8)
IDS = torch.tensor([[1, 5, 9, 13, 17, 21]])


def _samples(engine, n=8):
    reqs = [{"id": f"s{i}", "prompt": "SFFF\nFPFH", "choices": ["L", "D", "R", "U"], "max_tokens": 2, "temperature": 1.0} for i in range(n)]
    return [
        {
            "prompt_ids": c.prompt_ids,
            "response_ids": c.token_ids,
            "logprobs": c.logprobs,
            "allowed_ids": c.allowed_ids,
            "advantage": 1.0 if c.text == "U" else -1.0,
        }
        for c in engine.generate(reqs)
    ]


def _trained(model_dir, steps=3):
    trainer = TorchTrainer(str(model_dir), lr=5e-2, lora=LORA)
    engine = TorchEngine(str(model_dir), lora=LORA)
    samples = _samples(engine)
    for _ in range(steps):
        trainer.train_step(samples)
    return trainer, engine


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_the_trainer_publishes_the_adapter_alone_and_leaves_the_base_frozen(model_dir):
    trainer = TorchTrainer(str(model_dir), lr=5e-2, lora=LORA)
    base_before = {k: v.clone() for k, v in trainer.model.get_base_model().state_dict().items() if "lora_" not in k}
    adapter_before = trainer.state_dict()
    assert adapter_before and all(".lora_A." in k or ".lora_B." in k for k in adapter_before)
    full = TorchTrainer(str(model_dir), lr=5e-2).state_dict()
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapter_before.values())
    assert adapter_bytes * 4 < sum(v.numel() * v.element_size() for v in full.values())
    trainer.train_step(_samples(TorchEngine(str(model_dir), lora=LORA)))
    after = trainer.state_dict()
    assert any(not torch.equal(after[k], adapter_before[k]) for k in after)  # the loss moved the adapter
    base_after = {k: v for k, v in trainer.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # and nothing else


def test_the_torch_engine_swaps_the_adapter_in_place(model_dir):
    trainer, engine = _trained(model_dir)
    base = {k: v.data_ptr() for k, v in engine.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert not torch.allclose(_logits(engine.model), _logits(trainer.model))  # the engine still has the untrained adapter
    assert engine.update_weights(3, trainer.state_dict()) == 3 and engine.version == 3
    assert torch.allclose(_logits(engine.model), _logits(trainer.model), atol=1e-6)
    # the base was not reloaded: the same tensors
    assert {k: v.data_ptr() for k, v in engine.model.get_base_model().state_dict().items() if "lora_" not in k} == base
    other = TorchTrainer(str(model_dir), lr=1e-3, lora=LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="trainer.lora must be the same"):
        engine.update_weights(4, other.state_dict())
    with pytest.raises(ValueError, match="target_modules=\\['attn'\\].*linear layers: \\[.*q_proj"):
        TorchTrainer(str(model_dir), lr=1e-3, lora=LoraConfig(target_modules=["attn"]))


def test_a_checkpoint_is_a_peft_adapter_and_rollart_merge_gives_the_same_logits(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollart_dask.entry.cli import main

    trainer, _ = _trained(model_dir)
    expected = _logits(trainer.model)
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "rollart.json").read_text())["lora"] is True
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()  # the adapter alone
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), ckpt)
    assert torch.allclose(_logits(peft), expected, atol=1e-6)

    res = CliRunner().invoke(main, ["merge", ckpt, "--out", str(tmp_path / "merged")])
    assert res.exit_code == 0, res.output
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert torch.allclose(_logits(merged), expected, atol=1e-5)
    assert not torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(str(model_dir))), expected, atol=1e-3)

    res = CliRunner().invoke(main, ["merge", str(model_dir), "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "holds no LoRA adapter" in res.output

    again = TorchTrainer(str(model_dir), lr=5e-2, lora=LORA)
    assert again.restore(ckpt) == 3 and torch.allclose(_logits(again.model), expected, atol=1e-6)
    full = TorchTrainer(str(model_dir), lr=5e-2)
    with pytest.raises(ValueError, match="holds a LoRA adapter, but this run does not train one"):
        full.restore(ckpt)


def test_the_flow_key_and_its_errors():
    cfg = load_flow(data=flow_dict(**{"trainer.lora": {"r": 16, "target_modules": ["q_proj", "v_proj"]}}))
    assert cfg.trainer.lora.r == 16 and cfg.trainer.lora.alpha == 16.0
    with pytest.raises(Exception, match="trainer.lora: LoRA is trained by trainer.backend=torch only"):
        load_flow(data=flow_dict(**{"trainer.lora": {"r": 8}, "trainer.backend": "emulated", "engine.backend": "emulated"}))
    with pytest.raises(Exception, match="target_modules"):
        load_flow(data=flow_dict(**{"trainer.lora": {"target_modules": []}}))


@pytest.mark.needs("vllm")
def test_vllm_and_the_torch_engine_give_the_same_greedy_tokens_after_each_adapter_swap(model_dir):
    from rollart_dask.data.engine_vllm import VLLMEngine

    trainer = TorchTrainer(str(model_dir), lr=1e-2, lora=LORA)
    vllm, torch_engine = VLLMEngine(str(model_dir), lora=LORA, max_batch=8), TorchEngine(str(model_dir), lora=LORA)
    prompts = ["SFFF\nFPFH", "GHFF\nPFFH", "FFFH\nHFFG"]

    def reqs(tag):
        return [{"id": f"{tag}{i}", "prompt": p, "choices": None, "max_tokens": 10, "temperature": 0.0} for i, p in enumerate(prompts)]

    before = [c.token_ids for c in vllm.generate(reqs("b"))]
    torch.manual_seed(1)
    for version in (1, 2):  # two swaps: the second replaces the first adapter
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.3)
        for engine in (vllm, torch_engine):
            assert engine.update_weights(version, trainer.state_dict()) == version
        a = [c.token_ids for c in vllm.generate(reqs(f"v{version}"))]
        b = [c.token_ids for c in torch_engine.generate(reqs(f"t{version}"))]
        assert a == b and a != before and all(len(t) > 1 for t in a)
        assert {c.version for c in vllm.generate(reqs(f"w{version}"))} == {version}
    assert vllm.stats["updates"] == 2
