"""Emulated trainer: the Trainer contract (data/contracts.py) with a step time from the hardware
profile (``train_step_seconds`` × ``time_scale``, slept on the wall clock) and the real protocol
around it: versions, a (tiny) state dict to publish, checkpoint and restore."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_dask.emulation.hardware import GPUS, H800, MODELS, QWEN3_8B, GPUProfile, ModelProfile, train_step_seconds

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, TrainerConfig


class EmulatedTrainer:
    label = "emulated"
    version: int

    def __init__(self, model: ModelProfile = QWEN3_8B, gpus: int = 8, gpu: GPUProfile = H800, time_scale: float = 1e-3):
        self.model, self.gpus, self.gpu, self.time_scale = model, gpus, gpu, float(time_scale)
        self.version = 0
        self.stats = {"steps": 0, "tokens": 0, "emulated_train_s": 0.0}

    @classmethod
    def from_config(
        cls, cfg: TrainerConfig, *, model_dir: str, seed: int = 0, temperature: float = 1.0, emulation: EmulationConfig | None = None
    ) -> EmulatedTrainer:
        """Times the profile of ``emulation.trainer``; the trainer section's learning keys have nothing to act on."""
        if emulation is None:
            raise ValueError("trainer.backend=emulated needs the flow's emulation section")
        t = emulation.trainer
        return cls(MODELS[emulation.model], gpus=t.gpus, gpu=GPUS[t.gpu], time_scale=emulation.time_scale)

    def step_seconds(self, tokens: int) -> float:
        """Emulated (unscaled) seconds of one optimizer step over ``tokens`` tokens."""
        return train_step_seconds(self.model, self.gpus, tokens, self.gpu)

    def train_step(self, samples: list[dict]) -> dict:
        """One emulated GRPO update: sleeps the profile's step time × time_scale; version + 1."""
        t0 = time.perf_counter()
        tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
        emulated = self.step_seconds(tokens)
        time.sleep(emulated * self.time_scale)
        self.version += 1
        self.stats["steps"] += 1
        self.stats["tokens"] += tokens
        self.stats["emulated_train_s"] += emulated
        return {
            "loss": 0.0,
            "grad_norm": 0.0,
            "samples": len(samples),
            "tokens": tokens,
            "response_tokens": sum(len(s["response_ids"]) for s in samples),
            "emulated_train_s": emulated,
            "train_s": time.perf_counter() - t0,
            "version": self.version,
            "trainer": self.label,
        }

    def warm_start(
        self, demos: list[dict], steps: int, batch_size: int, lr: float, seed: int = 0, shares: dict[str, float] | None = None
    ) -> dict:
        """No imitation to emulate: counts as one published version, like the real warm start."""
        self.version += 1
        return {"demos": len(demos), "steps": 0, "seconds": 0.0, "version": self.version, "trainer": self.label}

    def state_dict(self) -> dict:
        """What engines pull: the version alone (the emulated engine times a load of the profile's
        weight bytes itself). No torch: importing it in every worker would cost seconds per process."""
        return {"emulated.version": self.version}

    def save_checkpoint(self, path: str | Path) -> str:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "rollart.json").write_text(json.dumps({"version": self.version, "trainer": self.label, "model": self.model.name}))
        return str(path)

    def restore(self, path: str | Path) -> int:
        self.version = int(json.loads((Path(path) / "rollart.json").read_text())["version"])
        return self.version
