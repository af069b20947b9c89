"""One training step's record: what each phase of control/run.py's step measured, written as one metrics row."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """One training step's metrics, filled phase by phase and written once, when its Train is done."""

    step: int  # this run's step number (1, 2, …)
    rollout: dict = field(default_factory=dict)  # what rollout did since the last step (telemetry.rollout_row)
    batch: dict = field(default_factory=dict)  # what was trained: reward, success, signal, per task, staleness
    phases: dict = field(default_factory=dict)  # seconds: get_batch_s, suspend_s, update_s, recompute_kv_s, wait_train_s
    weights: dict | None = None  # the pull of the installed version (weights/store.py), when one was installed
    train: dict = field(default_factory=dict)  # the trainer's metrics
    version: int = 0  # the version this step's Train published

    def row(self) -> dict:
        pull = {"weights": self.weights} if self.weights is not None else {}
        return {
            "kind": "step",
            "step": self.version,
            "version": self.version,
            **self.batch,
            **self.rollout,
            **self.phases,
            **pull,
            **self.train,
        }
