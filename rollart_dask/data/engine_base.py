"""What every engine backend shares: prompt encoding with the model's own tokenizer (cached),
the cooperative abort set, and the counters the run reads for pool utilisation."""

from __future__ import annotations

import functools
import threading
import time

from rollart_dask.data.encoding import chat_prompt_ids
from rollart_dask.models.prompts import cut_at_stop


class RecentAborts:
    """The ids of aborted requests, each kept for ``ttl_s``. An abort and its request are separate Dask
    tasks, so the abort can reach the engine first: the request must then end at once when it comes,
    not run to completion (and Suspend wait for it). Ids of requests that never come expire."""

    def __init__(self, ttl_s: float = 600.0):
        self.ttl_s = ttl_s
        self._at: dict[str, float] = {}  # id → when aborted; insertion order = oldest first
        self._lock = threading.Lock()  # aborts come on the worker's event loop, requests end on engine threads

    def update(self, ids) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in ids:
                self._at.pop(rid, None)
                self._at[rid] = now
            while self._at:  # expire the oldest
                rid, t = next(iter(self._at.items()))
                if now - t < self.ttl_s:
                    break
                del self._at[rid]

    def discard(self, rid: str) -> None:
        with self._lock:
            self._at.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._at

    def __len__(self) -> int:
        return len(self._at)


class EngineBase:
    version: int  # the Engine contract's attributes (data/contracts.py)
    stats: dict

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.version = 0
        self._aborted = RecentAborts()
        self.stats = {"tokens": 0, "requests": 0, "busy_s": 0.0}

    def abort(self, request_ids: list[str]) -> int:
        """Cooperative: the engine checks the ids while it decodes (Dask cannot stop a running task), and when a
        request arrives after its abort."""
        self._aborted.update(request_ids)
        return len(request_ids)

    def encode(self, req: dict) -> list[int]:
        """The ids to prefill: the prompt's, then a continued request's ``prefix_ids`` (its response so far, made
        before a weight update; rollout.partial=continue) — decoding goes on from there."""
        ids = list(req["prompt_ids"]) if req.get("prompt_ids") is not None else list(self._template(req["prompt"]))
        return ids + list(req.get("prefix_ids") or [])

    def response_text(self, req: dict, token_ids: list[int]) -> str:
        """The whole response's text: a continued request's prefix and its new tokens, decoded together; with stop strings,
        the text before the first (the env acts on that; the trainer trains every token generated)."""
        text = self.tokenizer.decode(list(req.get("prefix_ids") or []) + list(token_ids), skip_special_tokens=True)
        return cut_at_stop(text, req.get("stop"))[0]

    def stopped(self, req: dict, token_ids: list[int]) -> bool:
        """Whether the response so far holds one of the request's stop strings."""
        return (
            bool(req.get("stop"))
            and cut_at_stop(
                self.tokenizer.decode(list(req.get("prefix_ids") or []) + list(token_ids), skip_special_tokens=True), req["stop"]
            )[1]
        )

    @functools.lru_cache(maxsize=65536)
    def _template(self, prompt) -> tuple[int, ...]:
        return tuple(chat_prompt_ids(self.tokenizer, prompt))
