"""A small Qwen2 model and a character tokenizer, built locally (nothing from a hub).

The tokenizer is a character-level WordLevel model over printable ASCII plus newline,
which covers every built-in task's alphabet; the model is randomly initialised from a
seed. Both are saved as a Hugging Face directory that transformers (and vLLM) load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<unk>"]
ALPHABET = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable + \n


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    # The chat template of a character model: the last user message followed by a newline.
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return fast


_BUILDING = threading.Lock()  # runs launched at once in one process: transformers' lazy imports are not thread-safe


def build_tiny_model(out_dir: str | Path, hidden_size=128, layers=2, heads=4, intermediate_size=512, seed=0) -> Path:
    """Build (once; cached by its settings) and return the model directory."""
    with _BUILDING:
        return _build_tiny_model(Path(out_dir), hidden_size, layers, heads, intermediate_size, seed)


def _build_tiny_model(out_dir: Path, hidden_size, layers, heads, intermediate_size, seed) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(hidden_size=hidden_size, layers=layers, heads=heads, intermediate_size=intermediate_size, seed=seed, v=1)
    tag = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(out_dir) / f"tiny-qwen2-{tag}"
    if (path / "config.json").exists():
        return path
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may be building the same model
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # that other process finished first: its copy is the same model
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tokenizer(model_dir: str | Path):
    """The tokenizer exactly as saved in tokenizer.json.

    AutoTokenizer in transformers 5 picks the class from the model type (Qwen2Tokenizer here)
    and replaces the saved pre-tokenizer, which would break the character tokenizer.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
