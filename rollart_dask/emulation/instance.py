"""One emulated inference instance (``EmulatedEngine``): the engine contract of the real backends on
the batch model (``batch.ContinuousBatch``), one driver thread sleeping emulated seconds × ``time_scale``.

Token ids are synthetic: one deterministic id stream per (seed, trajectory), where the trajectory
is ``emulate["stream"]`` or the request id before ``#``. A prompt of n tokens is the stream's
first n ids and the output continues it, so a later turn whose prompt extends the earlier one
hits the prefix cache the way a real multi-turn conversation does.

Per request, ``emulate`` (optional) sets ``prompt_tokens``, ``output_tokens``, ``text`` and
``stream``; without it the prompt length comes from ``prompt_ids``, the tokenizer, or ~4 chars
per token, and the output length from the chosen ``choices`` text or ``max_tokens``.
"""

from __future__ import annotations

import math
import random
import threading
import time
import zlib

import numpy as np

from rollart_dask.data.engine_base import RecentAborts
from rollart_dask.data.kv import PrefillHandle, StaleKVError
from rollart_dask.emulation.batch import ContinuousBatch, Seq
from rollart_dask.emulation.hardware import (
    H800,
    KV_LINK_GBPS,
    QWEN3_8B,
    GPUProfile,
    ModelProfile,
    kv_transfer_seconds,
    weight_load_seconds,
)
from rollart_dask.types import Completion


def _stream_ids(seed: int, key: str, start: int, n: int, vocab: int) -> list[int]:
    # numpy: a 30k-token multi-turn context is drawn in well under a millisecond (random.randrange: ~15 ms)
    rng = np.random.default_rng(zlib.crc32(f"{seed}:{key}".encode()))
    return rng.integers(0, vocab, start + n)[start:].tolist()


class EmulatedEngine:
    """Engine contract (``generate``, ``abort``, ``update_weights``, ``reset_prefix_cache``,
    ``stats``, ``version``) on the batch model; sleeps emulated seconds × ``time_scale``.

    One driver thread per engine owns the batch and the sleeping; ``generate`` callers (any
    number of threads) enqueue and wait for their own requests, so requests from concurrent
    calls share the batch as in a continuous-batching server."""

    label = "emulated"

    def __init__(
        self,
        model: ModelProfile = QWEN3_8B,
        gpu: GPUProfile = H800,
        tp: int = 1,
        time_scale: float = 1e-3,
        seed: int = 0,
        kv_tokens: int | None = None,
        tokenizer=None,
        weight_load_s: float | None = None,
        kv_link_gbps: float = KV_LINK_GBPS,
    ):
        self.model, self.gpu, self.tp, self.time_scale, self.seed = model, gpu, tp, float(time_scale), seed
        self.kv_link_gbps = kv_link_gbps  # ASSUMED link for prefill/decode disaggregation (hardware.KV_LINK_GBPS)
        self.tokenizer = tokenizer
        self.batch = ContinuousBatch(model, gpu, tp, kv_tokens)
        self.weight_load_s = weight_load_seconds(model, gpu, tp) if weight_load_s is None else weight_load_s
        self.version = 0
        self.stats = {
            "tokens": 0,
            "requests": 0,
            "busy_s": 0.0,
            "emulated_busy_s": 0.0,
            "engine": self.label,
            "gpu": gpu.name,
            "model": model.name,
            "time_scale": self.time_scale,
        }
        self._aborted = RecentAborts()  # every abort, for a while: one may come before its request
        self._fresh_aborts: set[str] = set()  # aborts the driver has not applied to the batch yet
        self._cond = threading.Condition()
        self._events: dict[str, threading.Event] = {}
        self._driver: threading.Thread | None = None
        self._t0 = time.perf_counter()
        self._stall_until = 0.0  # emulated time until which a weight load blocks decoding

    # -- emulated clock ----------------------------------------------------------------------------
    def _now(self) -> float:
        """Emulated seconds since start (wall / time_scale); with time_scale 0 the batch clock itself."""
        if self.time_scale <= 0:
            return self.batch.clock
        return (time.perf_counter() - self._t0) / self.time_scale

    def _wait_until(self, t: float, interruptible: bool) -> None:
        """Sleep (holding no lock but the condition's) until emulated time ``t``."""
        while self.time_scale > 0:
            left = (t - self._now()) * self.time_scale
            if left <= 0:
                return
            self._cond.wait(left)
            if interruptible:
                return

    # -- contract ----------------------------------------------------------------------------------
    def generate(self, requests: list[dict]) -> list[Completion]:
        seqs = [self._seq(r) for r in requests]
        self._run(seqs)
        return self._account(requests, seqs)

    def _run(self, seqs: list[Seq]) -> None:
        """Queue the requests on the batch and wait until each is done."""
        events = []
        for s in seqs:  # all or nothing: an oversize request fails the call before any is queued
            if s.reserve > self.batch.kv_capacity:
                raise ValueError(f"request {s.rid} needs {s.reserve} KV tokens; the instance holds {self.batch.kv_capacity}")
        with self._cond:
            for s in seqs:
                if s.rid in self._aborted:  # its abort came first: it ends now, never queued
                    s.finish, s.t_done = "abort", s.arrival
                    self._aborted.discard(s.rid)
                    continue
                self.batch.submit(s)
                ev = self._events[s.rid] = threading.Event()
                events.append(ev)
            if self._driver is None or not self._driver.is_alive():
                self._driver = threading.Thread(target=self._drive, name="emulated-engine", daemon=True)
                self._driver.start()
            self._cond.notify_all()
        for ev in events:
            ev.wait()

    def _account(self, requests: list[dict], seqs: list[Seq]) -> list[Completion]:
        out = [self._completion(r, s) for r, s in zip(requests, seqs)]
        with self._cond:
            self.stats["tokens"] += sum(len(c.token_ids) for c in out)
            self.stats["requests"] += len(out)
            # wall seconds the requests spent in the engine (queue + prefill + decode): what a generate call
            # would cost with no control plane around it
            self.stats["request_s"] = (
                self.stats.get("request_s", 0.0) + sum(max(0.0, (s.t_done or s.arrival) - s.arrival) for s in seqs) * self.time_scale
            )
            for k, v in self.batch.counters.items():
                self.stats[k] = v
        return out

    # -- prefill/decode disaggregation (data/kv.py), modelled ---------------------------------------
    def prefill(self, requests: list[dict]) -> list[PrefillHandle]:
        """The prefill (compute-bound, this instance's GPU) and first token of each request; the handle carries
        the KV size from the model profile (nothing real to ship) and the modelled times, labelled emulated."""
        from dataclasses import replace

        full = [self._seq(r) for r in requests]
        seqs = [replace(s, output_tokens=1, output_ids=s.output_ids[:1]) for s in full]
        self._run(seqs)
        handles = []
        for r, f, s in zip(requests, full, seqs):
            done = s.finish == "abort" or f.output_tokens <= 1
            c = self._completion(r, s if s.finish == "abort" else f) if done else None
            handles.append(
                PrefillHandle(
                    request=r,
                    prompt_ids=s.prompt_ids,
                    token_ids=list(s.output_ids[:1]) if s.finish != "abort" else [],
                    logprobs=[-math.log(len(r["choices"])) if r.get("choices") else -1.0] if s.finish != "abort" else [],
                    allowed_ids=None,
                    finish=c.finish_reason if c else None,
                    version=s.version,
                    positions=s.prompt_tokens,
                    emulated={
                        "kv_bytes": 0 if done else self.model.kv_bytes_per_token * s.prompt_tokens,
                        "output_tokens": f.output_tokens,
                        "text": f.text,
                        "prefill_s": (s.t_first or s.arrival) - s.arrival,
                        "gpu": self.gpu.name,
                        "completion": c,
                    },
                )
            )
        with self._cond:
            st = self.stats
            st["requests_prefilled"] = st.get("requests_prefilled", 0) + len(requests)
            st["pd_prefill_requests"] = st.get("pd_prefill_requests", 0) + len(requests)
            emulated = sum(h.emulated["prefill_s"] for h in handles)
            st["pd_emulated_prefill_s"] = st.get("pd_emulated_prefill_s", 0.0) + emulated
            st["pd_prefill_s"] = st.get("pd_prefill_s", 0.0) + emulated * self.time_scale
            st["pd_kv_bytes_out"] = st.get("pd_kv_bytes_out", 0) + sum(h.kv_bytes for h in handles)
            for k, v in self.batch.counters.items():
                st[k] = v
        return handles

    def decode_from_prefill(self, handles: list[PrefillHandle], stale: str = "reprefill") -> list[Completion]:
        """The KV transfer (KV bytes / ``kv_link_gbps``, an assumed link; slept at ``time_scale``), then the decode
        on this instance's GPU, the prompt's KV held but not recomputed. Stale handles: as the torch engine."""
        if stale not in ("reprefill", "error"):
            raise ValueError(f"stale must be 'reprefill' or 'error', got {stale!r}")
        out: list = [None] * len(handles)
        todo, old = [], []
        for j, h in enumerate(handles):
            if h.finish is not None:  # ended at prefill (or aborted there): nothing to decode
                out[j] = h.emulated.get("completion") or Completion(h.request["id"], h.prompt_ids, [], [], None, "", "abort", h.version)
            elif h.version != self.version:
                old.append(j)
            else:
                todo.append(j)
        if old and stale == "error":
            h = handles[old[0]]
            raise StaleKVError(
                f"KV cache of request {h.request['id']} was prefilled at policy version {h.version}; "
                f"this engine is at version {self.version}"
            )
        transfer = max((kv_transfer_seconds(self.model, handles[j].positions, self.kv_link_gbps) for j in todo), default=0.0)
        if transfer and self.time_scale > 0:  # the caches cross the link before the requests can join the batch
            time.sleep(transfer * self.time_scale)
        seqs = []
        for j in todo:
            h = handles[j]
            s = self._seq(h.request)
            s.output_tokens, s.text, s.kv_imported = int(h.emulated["output_tokens"]), h.emulated["text"], True
            s.output_ids = (
                range(len(s.prompt_ids), len(s.prompt_ids) + s.output_tokens)
                if s.stream is not None
                else list(h.token_ids)
                + _stream_ids(self.seed, s.rid.split("#")[0], len(s.prompt_ids) + 1, s.output_tokens - 1, self.model.vocab)
            )
            seqs.append(s)
        if seqs:
            self._run(seqs)
            for j, c in zip(todo, self._account([handles[j].request for j in todo], seqs)):
                out[j] = c
        if old:  # prefilled at another version: recomputed here under this instance's weights
            for j, c in zip(old, self.generate([handles[j].request for j in old])):
                out[j] = c
        with self._cond:
            st = self.stats
            st["pd_decode_requests"] = st.get("pd_decode_requests", 0) + len(handles)
            emulated = sum((s.t_done or s.arrival) - s.arrival for s in seqs)
            st["pd_emulated_decode_s"] = st.get("pd_emulated_decode_s", 0.0) + emulated
            st["pd_decode_s"] = st.get("pd_decode_s", 0.0) + emulated * self.time_scale
            st["pd_kv_bytes_in"] = st.get("pd_kv_bytes_in", 0) + sum(handles[j].kv_bytes for j in todo)
            st["pd_emulated_kv_transfer_s"] = st.get("pd_emulated_kv_transfer_s", 0.0) + transfer
            st["pd_kv_transfer_s"] = st.get("pd_kv_transfer_s", 0.0) + transfer * self.time_scale
            st["pd_reprefilled"] = st.get("pd_reprefilled", 0) + len(old)
        return out

    def abort(self, request_ids: list[str]) -> int:
        """Cooperative like the real engines: requests end at the next step boundary."""
        with self._cond:
            self._aborted.update(request_ids)
            self._fresh_aborts.update(request_ids)
            self._cond.notify_all()
        return len(request_ids)

    def update_weights(self, version: int, weights=None) -> int:
        """Bumps the version after an emulated weight load (host → HBM) that stalls decoding;
        the prefix cache goes too (its KV came from the old weights), as in the torch engine."""
        with self._cond:
            start = max(self._now(), self.batch.clock, self._stall_until)
            self._stall_until = start + self.weight_load_s
            self.version = version
            self.batch.reset_cache()
            self.stats["weight_loads"] = self.stats.get("weight_loads", 0) + 1
            self._cond.notify_all()
            self._wait_until(self._stall_until, interruptible=False)
        return version

    def reset_prefix_cache(self) -> int:
        with self._cond:
            return self.batch.reset_cache()

    # -- driver ------------------------------------------------------------------------------------
    def _drive(self) -> None:
        b = self.batch
        with self._cond:
            while True:
                self._apply_aborts()
                if not b.waiting and not b.running:
                    if not self._cond.wait(timeout=30.0) and not b.waiting:
                        self._driver = None
                        return  # idle: a later generate starts a new driver
                    continue
                b.clock = max(b.clock, self._stall_until, self._now() if not b.running else b.clock)
                t_start = b.clock
                if b.waiting and b.kv_used + b.waiting[0].reserve <= b.kv_capacity:
                    done = b.admit(self.version)
                    self._busy(b.clock - t_start)
                    self._wait_until(b.clock, interruptible=False)  # a prefill is not interrupted
                    self._release(done)
                    continue
                if not b.running:  # the queue head waits for KV that only a finish frees
                    self._cond.wait(timeout=1.0)
                    continue
                k = min(b.steps_to_next_finish(), 64)  # at most 64 step costs per wake: arrivals wake the driver often
                costs = [b.step_cost(i) for i in range(k)]
                self._wait_until(b.clock + sum(costs), interruptible=True)
                now = self._now() if self.time_scale > 0 else math.inf
                steps, t = 0, b.clock
                while steps < k and t + costs[steps] <= now + 1e-12:
                    t += costs[steps]
                    steps += 1
                if steps:
                    done = b.decode(steps)
                    self._busy(b.clock - t_start)
                    self._release(done)

    def _apply_aborts(self) -> None:
        if not self._fresh_aborts:
            return
        live = {s.rid for s in self.batch.waiting} | set(self.batch.running)
        hit = self._fresh_aborts & live
        if hit:
            self._release(self.batch.abort(hit))
            for rid in hit:
                self._aborted.discard(rid)
        self._fresh_aborts.clear()  # the rest: done already, on another instance, or not come yet (kept in _aborted)

    def _busy(self, emulated_s: float) -> None:
        self.stats["emulated_busy_s"] += emulated_s
        self.stats["busy_s"] += emulated_s * self.time_scale

    def _release(self, seqs: list[Seq]) -> None:
        for s in seqs:
            ev = self._events.pop(s.rid, None)
            if ev is not None:
                ev.set()

    # -- requests and completions ------------------------------------------------------------------
    def _seq(self, r: dict) -> Seq:
        emu = r.get("emulate") or {}
        rid = str(r["id"])
        key = str(emu.get("stream") or rid.split("#")[0])
        stream = None
        if "prompt_tokens" in emu:  # a synthetic stream: only counts matter, no ids are drawn
            prompt, stream = range(int(emu["prompt_tokens"])), key
        elif r.get("prompt_ids") is not None:
            prompt = list(r["prompt_ids"])
        elif self.tokenizer is not None:
            prompt = list(self.tokenizer.encode(r["prompt"]))
        else:  # ~4 characters per token; equal text prefixes give equal id prefixes
            text = r.get("prompt") or ""
            prompt = [zlib.crc32(text[i : i + 4].encode()) % self.model.vocab for i in range(0, len(text), 4)] or [0]
        limit = int(r.get("max_tokens", 16))
        choices = r.get("choices")
        text = str(emu.get("text", ""))
        if choices:
            salt = r.get("prompt") if float(r.get("temperature", 1.0)) <= 0 else rid  # greedy: same prompt, same action
            text = choices[random.Random(zlib.crc32(f"{self.seed}:{salt}".encode())).randrange(len(choices))]
        if "output_tokens" in emu:
            n = int(emu["output_tokens"])
        elif choices:
            n = min(limit, max(1, math.ceil(len(text) / 4)))
        else:
            n = limit
        prefix = r.get("prefix_ids") or ()
        if prefix:  # a continued request (rollout.partial=continue): its response so far is prefilled, the rest generated
            prompt = range(len(prompt) + len(prefix)) if stream is not None else list(prompt) + list(prefix)
            if "output_tokens" in emu:
                n -= len(prefix)
        s = Seq(rid, prompt, max(1, n), arrival=self._now(), version=self.version, text=text, stream=stream)
        s.output_ids = (
            range(len(prompt), len(prompt) + s.output_tokens)
            if stream is not None
            else _stream_ids(self.seed, key, len(prompt), s.output_tokens, self.model.vocab)
        )
        return s

    def _completion(self, r: dict, s: Seq) -> Completion:
        if s.finish == "abort":  # what it generated before the abort: a continuation goes on from it
            return Completion(s.rid, s.prompt_ids, s.output_ids[: s.generated], [-1.0] * s.generated, None, "", "abort", s.version)
        choices = r.get("choices")
        lp = -math.log(len(choices)) if choices else -1.0
        reason = "length" if (not choices and s.output_tokens >= int(r.get("max_tokens", 16))) else "stop"
        # a synthetic stream's ids are ranges: only their counts matter downstream (no 30k-int lists per turn)
        return Completion(s.rid, s.prompt_ids, s.output_ids, [lp] + [0.0] * (s.output_tokens - 1), None, s.text, reason, s.version)
