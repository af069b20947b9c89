"""Emulated hardware for system ablations: profiles and timing formulas (``hardware``), an
inference engine and a trainer that keep the real contracts but take their time from the
profiles (``engine``, ``trainer``), and the zero-overhead ideal step time (``ideal``).
Everything here is labelled ``emulated``."""

from rollart_dask.emulation.hardware import (  # noqa: F401
    GPUS,
    H20,
    H800,
    MODELS,
    QWEN3_8B,
    QWEN3_14B,
    QWEN3_32B,
    GPUProfile,
    ModelProfile,
)

LABEL = "emulated"
