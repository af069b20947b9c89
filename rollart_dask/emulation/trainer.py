"""Emulated trainer: the TorchTrainer interface the runtime uses, with a step time from the
hardware profile (``train_step_seconds`` × ``time_scale``, slept on the wall clock) and the real
protocol around it: versions, a (tiny) state dict to publish, checkpoint and restore."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .hardware import H800, QWEN3_8B, GPUProfile, ModelProfile, train_step_seconds


class EmulatedTrainer:
    label = "emulated"

    def __init__(self, model: ModelProfile = QWEN3_8B, gpus: int = 8, gpu: GPUProfile = H800, time_scale: float = 1e-3, **_ignored):
        self.model, self.gpus, self.gpu, self.time_scale = model, gpus, gpu, float(time_scale)
        self.version = 0
        self.stats = {"steps": 0, "tokens": 0, "emulated_train_s": 0.0}

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
        return {"loss": 0.0, "grad_norm": 0.0, "samples": len(samples), "tokens": tokens,
                "response_tokens": sum(len(s["response_ids"]) for s in samples), "emulated_train_s": emulated,
                "train_s": time.perf_counter() - t0, "version": self.version, "trainer": self.label}

    def warm_start(self, demos: list[dict], steps: int = 0, *args, **kwargs) -> dict:
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
