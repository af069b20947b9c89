"""Prefill/decode (PD) disaggregation's plain data: what a decode engine needs to continue a request
prefilled on another engine (``rollout.pd: {prefill: H800, decode: H20}``).

A handle holds the prompt's KV cache as CPU tensors per layer (``[kv_heads, prompt_len, head_dim]``,
no padding), the first token with its log-prob, the positions and the policy version — so Dask
pickles it and moves it worker to worker when the decode task, which takes the prefill task's future
as its argument, runs on another worker.

Versions: a KV cache prefilled at policy version v is never decoded by an engine at another
version. The decode engine re-prefills such a request from its prompt under its own weights
(counted as ``pd_reprefilled``), or raises ``StaleKVError`` when asked to (``stale="error"``).
In a run this hardly happens: Suspend aborts both phases of every request in flight before
weights change, and aborted requests are re-issued after Resume.

Backends (capabilities.PD): torch real (``TorchEngine.prefill`` / ``decode_from_prefill``), emulated
modelled (prefill on the prefill pool's GPU profile, KV transfer over an assumed link, decode on the
decode pool's profile); vllm refused (see capabilities.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class StaleKVError(RuntimeError):
    """A KV cache from one policy version offered to an engine at another."""


@dataclass(eq=False)  # compared by identity: it holds tensors
class PrefillHandle:
    """What a decode engine needs to continue a request prefilled elsewhere."""

    request: dict  # the generate request as issued (id, choices, max_tokens, temperature, …)
    prompt_ids: list[int]
    token_ids: list[int]  # the first token (none when aborted)
    logprobs: list[float]
    allowed_ids: list[list[int]] | None  # per token: the ids decoding was restricted to (None = full vocab)
    finish: str | None  # "stop" / "length" / "abort" when the request ended at prefill (nothing to ship), else None
    version: int  # policy version of the prefill engine
    kv: list[tuple[Any, Any]] | None = None  # per layer (keys, values), CPU tensors [kv_heads, positions, head_dim]
    positions: int = 0  # tokens in the cache (= prompt length); the first token's position
    prefill_s: float = 0.0  # wall seconds of the prefill batch this request was in
    emulated: dict = field(default_factory=dict)  # emulated engine: modelled timing and sizes (labelled)

    @property
    def kv_bytes(self) -> int:
        if self.emulated:
            return int(self.emulated.get("kv_bytes", 0))
        if not self.kv:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)
