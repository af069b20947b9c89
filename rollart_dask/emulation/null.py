"""The NULL engine: the engine contract with no model and no timing model — every request is answered at
once (or after a fixed ``generate_s``, the service-bound benchmark's service time), with the token counts an
emulated workload env asks for (else one token). For measuring what the control plane itself costs
(benchmarks/control_plane.py); labelled ``null`` wherever it reports, never a default, and it learns
nothing (pair it with ``trainer.backend: emulated``).

Streamed like the emulated engine: each request is started on ``pool`` and answered alone, as continuous
batching does; a request's time is its own (it waits for no batch), so the streamed task runs fast ones
inline (``answers_alone``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rollart_dask.data.engine_base import RecentAborts
from rollart_dask.types import Completion

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig


class NullEngine:
    label = "null"
    answers_alone = True
    version: int
    stats: dict
    pool: ThreadPoolExecutor

    def __init__(self, generate_s: float = 0.0):
        self.version, self.generate_s = 0, float(generate_s)
        self.stats = {"tokens": 0, "requests": 0, "busy_s": 0.0, "request_s": 0.0, "engine": self.label}
        self.pool = ThreadPoolExecutor(1024, thread_name_prefix="null-request")
        self._aborted = RecentAborts()  # an abort can come before its request (separate tasks): it then ends at once

    @classmethod
    def from_config(
        cls,
        cfg: EngineConfig,
        *,
        model_dir: str,
        seed: int = 0,
        pool: str | None = None,
        emulation: EmulationConfig | None = None,
        lora=None,
    ) -> NullEngine:  # (lora: never, the flow refuses it)
        """``emulation.null_generate_s`` (emulated seconds, slept at ``emulation.time_scale``): each request's service time."""
        return cls(emulation.null_generate_s * emulation.time_scale if emulation is not None else 0.0)

    def generate(self, requests: list[dict]) -> list[Completion]:
        if self.generate_s:
            time.sleep(self.generate_s)
            self.stats["request_s"] += self.generate_s * len(requests)
        out = []
        for r in requests:
            emu = r.get("emulate") or {}
            prompt = range(int(emu.get("prompt_tokens", 1)))
            if r["id"] in self._aborted:
                self._aborted.discard(r["id"])
                out.append(Completion(r["id"], prompt, [], [], None, "", "abort", self.version))
                continue
            choices = r.get("choices")
            n = max(1, int(emu.get("output_tokens", 1)))
            text = choices[0] if choices else str(emu.get("text", ""))
            out.append(
                Completion(
                    r["id"],
                    prompt,
                    range(len(prompt), len(prompt) + n),
                    [0.0] * n,
                    None,
                    text,
                    "stop" if choices else "length",
                    self.version,
                )
            )
            self.stats["tokens"] += n
        self.stats["requests"] += len(requests)
        return out

    def abort(self, request_ids: list[str]) -> int:
        self._aborted.update(request_ids)
        return len(request_ids)

    def update_weights(self, version: int, weights=None) -> int:
        self.version = version
        return version

    def reset_prefix_cache(self) -> int:
        return 0
