"""The model directory a flow runs: a tiny model built locally (cached), SmolLM2-135M from its wheel, a given HF directory, or
none at all for emulated hardware (its "model" is a timing profile)."""

from __future__ import annotations

import os
from pathlib import Path

from rollart_dask.config import FlowConfig, ModelConfig


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart-dask"))


def prepare_model(cfg: FlowConfig) -> Path:
    if cfg.emulated:  # EMULATED engines and trainer have no weights: their model is a timing profile
        return Path(f"emulated:{cfg.emulation.model}")
    return model_dir(cfg.model)


def model_dir(m: ModelConfig) -> Path:
    """The Hugging Face directory of a model section (built and cached where it is built here)."""
    if m.kind == "path":
        path = Path(m.path)  # type: ignore[arg-type]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face model directory (no config.json)")
        return path
    if m.kind == "smollm2":
        from rollart_dask.models.smollm2 import build_smollm2

        return build_smollm2(cache_dir() / "models")
    from rollart_dask.models.tiny import build_tiny_model

    return build_tiny_model(cache_dir() / "models", m.hidden_size, m.layers, m.heads, m.intermediate_size, m.seed)
