"""LoRA adapters (peft) on a frozen base: what the trainer trains, publishes and checkpoints, and what engines swap in.

With ``trainer.lora`` the trainer's ``state_dict()`` is the adapter alone, in peft's names
(``base_model.model.<module>.lora_A.weight``, the keys of ``adapter_model.safetensors``): the weight
stores bucket, checksum and move only those bytes, and every engine, built on the same base with an
adapter of the same shape, loads them in place. A directory written by ``save_adapter`` is what peft
(``PeftModel.from_pretrained``) and vLLM (``LoRARequest``) load; ``merge`` folds one into a full
Hugging Face model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_dask.extras import require

if TYPE_CHECKING:
    from rollart_dask.config import LoraConfig

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_config(lora: LoraConfig, base_dir: str | Path | None = None):
    require("peft", "llm", "trainer.lora")
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_dir) if base_dir else None,
    )


def wrap(model, lora: LoraConfig, base_dir: str | Path | None = None):
    """``model`` with a fresh adapter on ``lora.target_modules``; only the adapter is trainable. The adapter's B
    starts at zero, so before its first update the model computes exactly what the base does."""
    require("peft", "llm", "trainer.lora")
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, peft_config(lora, base_dir))
    except ValueError as e:  # e.g. none of the target modules is in this model
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise ValueError(f"trainer.lora.target_modules={list(lora.target_modules)}: {e} (this model's linear layers: {names})") from None
    wrapped.rollart_adapter_names = frozenset(_state_names(wrapped))  # fixed from now on: every swap checks against them
    return wrapped


def adapter_state(model) -> dict:
    """The adapter's tensors (detached copies), in the names its files use."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter(model, weights: dict) -> None:
    """Swap ``weights`` (an ``adapter_state``) into ``model``'s adapter in place; the base is not touched.
    Anything that does not fit (an unknown name, a missing adapter tensor, another shape) is an error."""
    from peft import set_peft_model_state_dict

    expected = getattr(model, "rollart_adapter_names", None) or frozenset(_state_names(model))
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(
            f"adapter weights do not fit the engine's adapter (trainer.lora must be the same on both sides): "
            f"missing={missing[:3]} unexpected={unexpected[:3]}"
        )
    set_peft_model_state_dict(model, weights)


def _state_names(model) -> list[str]:
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model))


def save_adapter(weights: dict, lora: LoraConfig, base_dir: str | Path, path: str | Path) -> Path:
    """Write an adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) peft and vLLM load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base_dir).save_pretrained(str(path))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / ADAPTER_FILE))
    return path


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merge(adapter_dir: str | Path, out: str | Path, base_dir: str | Path | None = None) -> Path:
    """A full Hugging Face model directory: the base (``base_dir``, or the adapter config's
    ``base_model_name_or_path``) with the adapter folded into its weights, plus the tokenizer."""
    import torch

    require("peft", "llm", "merging a LoRA adapter")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rollart_dask.models.tiny import load_tokenizer

    adapter_dir = Path(adapter_dir)
    if not is_adapter_dir(adapter_dir):
        raise FileNotFoundError(
            f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG} missing): a checkpoint of a run with "
            "trainer.lora, or an adapter directory"
        )
    base = base_dir or json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise FileNotFoundError(f"the adapter's base model {base!r} is not a Hugging Face model directory here: pass it with --base")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = Path(out)
    merged.save_pretrained(str(out))
    tokenizer_from = adapter_dir if (adapter_dir / "tokenizer.json").is_file() else Path(base)
    load_tokenizer(str(tokenizer_from)).save_pretrained(str(out))
    return out
