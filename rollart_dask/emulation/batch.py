"""The timing model of one emulated inference instance (``ContinuousBatch``), pure and clock-free;
``instance.EmulatedEngine`` drives it against the wall clock. Labelled ``emulated`` everywhere it reports.

- Requests queue FIFO and are admitted while their KV reservation (prompt + output tokens)
  fits the instance's KV capacity; the rest wait (no preemption).
- Requests admitted together are prefilled as one compute-bound batch (FLOPs add up, weights
  read once); the prefill yields each request's first token. Decoding stalls meanwhile (no
  chunked prefill).
- Then one decode step at a time for the live batch, each costing
  ``decode_step_seconds(batch, total context)``; a request leaves as soon as its own output is
  done, so a long request never holds a short one back, and queued requests join at a step boundary.
- Prefix cache: 16-token blocks chained by hash, LRU, as large as the KV capacity; a hit skips
  the prefill of the cached tokens (the last prompt token is always recomputed). Requests of a
  synthetic stream (``emulate``) skip the hashing: their ids are the stream's own prefix by
  construction, so the cache keeps, per stream, how many of its leading tokens it holds (whole
  blocks; LRU by stream, the same token capacity) — O(1) per request instead of O(context).
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field

from rollart_dask.emulation.hardware import (
    GPUProfile,
    ModelProfile,
    decode_step_seconds,
    kv_capacity_tokens,
    prefill_batch_seconds,
    prefill_flops,
)

BLOCK = 16  # prefix-cache block, tokens (vLLM's default block size)


@dataclass
class Seq:
    """One request inside the batch model. Times are emulated seconds."""

    rid: str
    prompt_ids: list[int]
    output_tokens: int
    arrival: float = 0.0
    cached: int = 0  # prompt tokens served by the prefix cache
    admit_step: int = -1
    t_first: float | None = None  # first token (end of its prefill)
    t_done: float | None = None
    finish: str | None = None
    version: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    stream: str | None = None  # a synthetic stream: ids are ranges, the cache counts the stream's prefix
    kv_imported: bool = False  # prefill/decode disaggregation: the prompt's KV came from a prefill instance (no prefill here)
    generated: int = 0  # tokens generated when aborted (the first at the end of its prefill, one per decode step after)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def reserve(self) -> int:
        return self.prompt_tokens + self.output_tokens


def block_hashes(ids: list[int]) -> list[int]:
    """Chained hashes of the full 16-token blocks (a block's hash names its whole prefix)."""
    out, h = [], 0
    for i in range(0, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[i : i + BLOCK])))  # ints and tuples of ints hash the same in every process
        out.append(h)
    return out


class ContinuousBatch:
    """The clock-free batch model: ``admit`` then ``decode`` advance ``clock`` (emulated seconds)."""

    def __init__(self, model: ModelProfile, gpu: GPUProfile, tp: int = 1, kv_tokens: int | None = None):
        self.model, self.gpu, self.tp = model, gpu, tp
        self.kv_capacity = kv_tokens if kv_tokens is not None else kv_capacity_tokens(model, gpu, tp)
        self.clock = 0.0
        self.step_no = 0
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: dict[str, Seq] = {}
        self._finish_heap: list[tuple[int, int, str]] = []
        self._ctx_base = 0  # Σ (prompt + 1 − admit_step) over running; context = base + B × step_no
        self.kv_used = 0
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.cache_blocks = max(1, self.kv_capacity // BLOCK)
        self.stream_cache: collections.OrderedDict[str, int] = collections.OrderedDict()  # stream → cached leading tokens
        self._stream_tokens = 0
        self.counters = {"prefill_tokens": 0, "cached_tokens": 0, "decode_steps": 0, "max_batch": 0, "imported_tokens": 0}

    # -- queue ---------------------------------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        if seq.reserve > self.kv_capacity:
            raise ValueError(f"request {seq.rid} needs {seq.reserve} KV tokens; the instance holds {self.kv_capacity}")
        self.waiting.append(seq)

    @property
    def context_tokens(self) -> int:
        return self._ctx_base + len(self.running) * self.step_no

    def admit(self, version: int = 0) -> list[Seq]:
        """Admit queued requests that fit (FIFO), prefill them together; returns those that
        finished with their first token. Advances the clock by the prefill time."""
        group: list[Seq] = []
        while self.waiting and self.kv_used + self.waiting[0].reserve <= self.kv_capacity:
            s = self.waiting.popleft()
            self.kv_used += s.reserve
            group.append(s)
        if not group:
            return []
        flops = 0.0
        for s in group:  # in order, so identical prompts admitted together are computed once
            if s.kv_imported:  # its prompt's KV arrived from a prefill instance: nothing to compute, only KV to hold
                s.cached = s.prompt_tokens
                self.counters["imported_tokens"] += s.prompt_tokens
                continue
            if s.stream is not None:
                hit = self.stream_cache.get(s.stream, 0)
                if hit:
                    self.stream_cache.move_to_end(s.stream)
            else:
                hashes = block_hashes(s.prompt_ids)
                hit = 0
                for h in hashes:
                    if h not in self.cache:
                        break
                    self.cache.move_to_end(h)
                    hit += BLOCK
            s.cached = min(hit, s.prompt_tokens - 1)
            new = s.prompt_tokens - s.cached
            flops += prefill_flops(self.model, new, s.cached)
            self.counters["prefill_tokens"] += new
            self.counters["cached_tokens"] += s.cached
            if s.stream is not None:
                self._remember_stream(s.stream, s.prompt_tokens)
            else:
                self._remember(hashes)
        if flops > 0:  # (a group of imported caches only costs no prefill)
            self.clock += prefill_batch_seconds(self.model, self.gpu, flops, self.tp)
        done = []
        for s in group:
            s.t_first, s.version, s.admit_step = self.clock, version, self.step_no
            if s.output_tokens <= 1:  # done with its first token: frees its KV at once
                self.kv_used -= s.reserve
                self._finish(s, "stop")
                done.append(s)
                continue
            self.running[s.rid] = s
            self._ctx_base += s.prompt_tokens + 1 - self.step_no
            heapq.heappush(self._finish_heap, (self.step_no + s.output_tokens - 1, id(s), s.rid))
        self.counters["max_batch"] = max(self.counters["max_batch"], len(self.running))
        return done

    # -- decoding ------------------------------------------------------------------------------
    def step_cost(self, ahead: int = 0) -> float:
        """Cost of the decode step ``ahead`` steps from now, if no one joins or leaves before it."""
        b = len(self.running)
        return decode_step_seconds(self.model, self.gpu, b, self.context_tokens + b * ahead, self.tp)

    def steps_to_next_finish(self) -> int:
        while self._finish_heap and self._finish_heap[0][2] not in self.running:
            heapq.heappop(self._finish_heap)  # aborted earlier
        return self._finish_heap[0][0] - self.step_no if self._finish_heap else 0

    def decode(self, steps: int) -> list[Seq]:
        """Run ``steps`` decode steps (never past the next finish); returns the requests that finished."""
        for _ in range(steps):
            self.clock += self.step_cost()
            self.step_no += 1
        self.counters["decode_steps"] += steps
        done = []
        while self._finish_heap and self._finish_heap[0][0] <= self.step_no:
            _, _, rid = heapq.heappop(self._finish_heap)
            s = self.running.get(rid)
            if s is not None:
                self._leave(s)
                self._finish(s, "stop")
                done.append(s)
        return done

    def abort(self, rids: set[str]) -> list[Seq]:
        """End the named requests now (queued or running) with finish "abort"."""
        out = [s for s in self.waiting if s.rid in rids]
        self.waiting = collections.deque(s for s in self.waiting if s.rid not in rids)
        for s in out:
            s.finish, s.t_done = "abort", self.clock
        for rid in [r for r in self.running if r in rids]:
            s = self.running[rid]
            self._leave(s)
            s.finish, s.t_done = "abort", self.clock
            s.generated = min(s.output_tokens, 1 + self.step_no - s.admit_step)
            out.append(s)
        return out

    def reset_cache(self) -> int:
        n = len(self.cache) + sum(self.stream_cache.values()) // BLOCK
        self.cache.clear()
        self.stream_cache.clear()
        self._stream_tokens = 0
        return n

    # -- internals -----------------------------------------------------------------------------
    def _leave(self, s: Seq) -> None:
        del self.running[s.rid]
        self._ctx_base -= s.prompt_tokens + 1 - s.admit_step
        self.kv_used -= s.reserve

    def _finish(self, s: Seq, reason: str) -> None:
        s.finish, s.t_done = reason, self.clock
        if s.stream is not None:
            self._remember_stream(s.stream, s.prompt_tokens + s.output_tokens)
        else:
            self._remember(block_hashes(list(s.prompt_ids) + list(s.output_ids)))

    def _remember_stream(self, stream: str, tokens: int) -> None:
        blocks = tokens // BLOCK * BLOCK
        old = self.stream_cache.get(stream, 0)
        if blocks > old:
            self.stream_cache[stream] = blocks
            self._stream_tokens += blocks - old
        if stream in self.stream_cache:
            self.stream_cache.move_to_end(stream)
        while self._stream_tokens > self.cache_blocks * BLOCK:
            _, n = self.stream_cache.popitem(last=False)
            self._stream_tokens -= n

    def _remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cache_blocks:
            self.cache.popitem(last=False)
