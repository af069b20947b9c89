"""What every engine backend shares: prompt encoding with the model's own tokenizer (cached),
the cooperative abort set, and the counters the run reads for pool utilisation."""
from __future__ import annotations

import functools

from rollart_dask.data.encoding import chat_prompt_ids


class EngineBase:
    version: int  # the Engine contract's attributes (data/contracts.py)
    stats: dict

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.version = 0
        self._aborted: set[str] = set()
        self.stats = {"tokens": 0, "requests": 0, "busy_s": 0.0}

    def abort(self, request_ids: list[str]) -> int:
        """Cooperative: the engine checks the set while it decodes (Dask cannot stop a running task)."""
        self._aborted.update(request_ids)
        return len(request_ids)

    def encode(self, req: dict) -> list[int]:
        if req.get("prompt_ids") is not None:
            return list(req["prompt_ids"])
        return list(self._template(req["prompt"]))

    @functools.lru_cache(maxsize=65536)
    def _template(self, prompt: str) -> tuple[int, ...]:
        return tuple(chat_prompt_ids(self.tokenizer, prompt))
