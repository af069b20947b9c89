"""Torch inference engine: batched generation with a KV cache on a transformers causal LM.

Contract: ``generate(requests) -> completions`` (token ids, per-token log-probs, finish
reason, policy version), ``abort(ids)``, ``update_weights(version, weights)``,
``reset_prefix_cache()``. Requests that arrive together are decoded as one batch
(left-padded, one forward per token for the whole batch). Constrained decoding restricts
each step to the token ids that continue one of the request's ``choices``.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import TYPE_CHECKING

import torch

from rollart_dask.algo.seeding import mixed_seed
from rollart_dask.types import Completion
from rollart_dask.data.backends import set_torch_threads
from rollart_dask.data.encoding import ChoiceTrie, choice_trie
from rollart_dask.data.engine_base import EngineBase
from rollart_dask.data.kv import PrefillHandle, StaleKVError

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig, LoraConfig


class TorchEngine(EngineBase):
    def __init__(self, model_dir: str, seed: int = 0, max_batch: int = 1024, lora: LoraConfig | None = None):
        from transformers import AutoModelForCausalLM

        from rollart_dask.models.tiny import load_tokenizer

        super().__init__(load_tokenizer(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lora = lora
        if lora is not None:  # the trainer's adapter is swapped in at each update; the base stays as loaded
            from rollart_dask.data.lora import wrap

            self.model = wrap(self.model, lora, model_dir).eval()
        self.max_batch = max_batch
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # one batch or one weight swap at a time
        self._prefix_cache: dict = {}  # prompts are short here; kept for the contract
        self._shipped: collections.OrderedDict[str, None] = collections.OrderedDict()  # PD: ids prefilled here and handed on

    @classmethod
    def from_config(
        cls,
        cfg: EngineConfig,
        *,
        model_dir: str,
        seed: int = 0,
        pool: str | None = None,
        emulation: EmulationConfig | None = None,
        lora: LoraConfig | None = None,
    ) -> TorchEngine:
        set_torch_threads()
        return cls(model_dir, seed=seed, max_batch=cfg.max_batch, lora=lora)

    # -- contract ---------------------------------------------------------------------------
    def abort(self, request_ids: list[str]) -> int:
        """A request this engine prefilled and handed on (PD) is the decode engine's to abort: its id is
        not kept here, where nothing would ever clear it."""
        return super().abort([r for r in request_ids if r not in self._shipped])

    def reset_prefix_cache(self) -> int:
        n = len(self._prefix_cache)
        self._prefix_cache.clear()
        return n

    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        with self._lock:
            if self.lora is not None:  # adapter weights only (trainer.lora), loaded in place
                from rollart_dask.data.lora import load_adapter

                load_adapter(self.model, weights)
                self.version = version
                self._prefix_cache.clear()
                return version
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            real_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied embeddings
            if real_missing or unexpected:
                raise ValueError(f"weights do not fit the engine model: missing={real_missing[:5]} unexpected={unexpected[:5]}")
            self.version = version
            self._prefix_cache.clear()
        return version

    def generate(self, requests: list[dict]) -> list[Completion]:
        out: list[Completion] = []
        for i in range(0, len(requests), self.max_batch):
            out += self._generate_batch(requests[i : i + self.max_batch])
        return out

    # -- batched decoding -------------------------------------------------------------------
    @functools.lru_cache(maxsize=1024)
    def _trie(self, choices: tuple[str, ...]) -> ChoiceTrie:
        return choice_trie(self.tokenizer, choices)

    @torch.no_grad()
    def _generate_batch(self, reqs: list[dict]) -> list[Completion]:
        """Decode a batch together: prefill, first token, decode loop — the same pieces PD uses."""
        with self._lock:
            t0 = time.perf_counter()
            b = self._start(reqs)
            self._first_token(b, self._prefill(b))
            self._decode(b)
            return self._finish(b, t0)

    # -- prefill/decode disaggregation (see data/kv.py) -----------------------------------
    @torch.no_grad()
    def prefill(self, requests: list[dict]) -> list[PrefillHandle]:
        """Prefill the prompts and sample each request's first token; returns per request what
        another engine needs to decode it (``decode_from_prefill``): the prompt's KV cache as plain
        CPU tensors per layer, the first token with its log-prob, the positions and the policy version."""
        out: list[PrefillHandle] = []
        for i in range(0, len(requests), self.max_batch):
            out += self._prefill_batch(requests[i : i + self.max_batch])
        return out

    def _prefill_batch(self, reqs: list[dict]) -> list[PrefillHandle]:
        with self._lock:
            t0 = time.perf_counter()
            b = self._start(reqs)
            self._first_token(b, self._prefill(b))
            handles = []
            for i, r in enumerate(reqs):
                kv = None
                if b.finish[i] is None:  # decoding goes on elsewhere: export this request's KV (no padding)
                    u, length = int(b.row[i]), len(b.prompts[i])
                    if any(getattr(layer, "is_sliding", False) for layer in b.cache.layers):
                        raise NotImplementedError("prefill/decode disaggregation of a model with sliding-window layers")
                    kv = [(layer.keys[u, :, -length:].clone(), layer.values[u, :, -length:].clone()) for layer in b.cache.layers]
                handles.append(
                    PrefillHandle(
                        request=r,
                        prompt_ids=b.prompts[i],
                        token_ids=list(b.tokens[i]),
                        logprobs=list(b.logps[i]),
                        allowed_ids=b.allowed_log[i],
                        finish=b.finish[i],
                        version=b.version,
                        kv=kv,
                        positions=len(b.prompts[i]),
                    )
                )
            for r in reqs:
                self._aborted.discard(r["id"])
                self._shipped[r["id"]] = None
            while len(self._shipped) > 65536:  # long after their decode: forget the oldest
                self._shipped.popitem(last=False)
            dt = time.perf_counter() - t0
            for h in handles:
                h.prefill_s = dt
            st = self.stats
            st["busy_s"] += dt
            st["pd_prefill_requests"] = st.get("pd_prefill_requests", 0) + len(reqs)
            st["pd_prefill_s"] = st.get("pd_prefill_s", 0.0) + dt
            st["pd_kv_bytes_out"] = st.get("pd_kv_bytes_out", 0) + sum(h.kv_bytes for h in handles)
            return handles

    @torch.no_grad()
    def decode_from_prefill(self, handles: list[PrefillHandle], stale: str = "reprefill") -> list[Completion]:
        """Continue decoding from KV caches prefilled elsewhere (greedy or sampled, choices included).

        A handle prefilled at another policy version than this engine's is never decoded on its
        cache: ``stale="reprefill"`` (default) recomputes that request here from its prompt under this
        engine's weights (first token included, so the whole completion is one version; counted as
        ``pd_reprefilled``); ``stale="error"`` raises StaleKVError."""
        if stale not in ("reprefill", "error"):
            raise ValueError(f"stale must be 'reprefill' or 'error', got {stale!r}")
        out: list[Completion] = []
        for i in range(0, len(handles), self.max_batch):
            out += self._decode_batch(handles[i : i + self.max_batch], stale)
        return out

    @torch.no_grad()
    def _decode_batch(self, handles: list[PrefillHandle], stale: str) -> list[Completion]:
        with self._lock:
            t0 = time.perf_counter()
            # a request still to decode whose cache came from another policy version (one ended at prefill is whole as it is)
            is_old = [h.finish is None and h.version != self.version and h.request["id"] not in self._aborted for h in handles]
            old = [h for h, o in zip(handles, is_old) if o]
            if old and stale == "error":
                raise StaleKVError(
                    f"KV cache of request {old[0].request['id']} was prefilled at policy version {old[0].version}; "
                    f"this engine is at version {self.version} (decode it where it was prefilled, or re-prefill)"
                )
            fresh = [h for h, o in zip(handles, is_old) if not o]
            b = self._start([h.request for h in fresh], [h.prompt_ids for h in fresh])
            for i, h in enumerate(fresh):  # the first token came from the prefill engine
                b.tokens[i], b.logps[i], b.finish[i] = list(h.token_ids), list(h.logprobs), h.finish
                if b.tries[i] is not None:
                    b.allowed_log[i] = [list(a) for a in h.allowed_ids or []]
                    for tok in h.token_ids:
                        b.nodes[i] = b.nodes[i][tok]
            live = [i for i in range(len(fresh)) if b.finish[i] is None]
            if live:
                self._import_kv(b, live, [fresh[i] for i in live])
            self._decode(b)
            done = dict(zip((h.request["id"] for h in fresh), self._finish(b, t0, count_busy=False)))
            for h in fresh:
                if h.finish is not None:  # ended at prefill: the whole completion is of the prefill's version
                    done[h.request["id"]].version = h.version
            if old:  # prefilled at another version: recomputed here under this engine's weights
                r = self._start([h.request for h in old], [h.prompt_ids for h in old])
                self._first_token(r, self._prefill(r))
                self._decode(r)
                done.update(zip((h.request["id"] for h in old), self._finish(r, t0, count_busy=False)))
            dt = time.perf_counter() - t0
            st = self.stats
            st["busy_s"] += dt
            st["pd_decode_requests"] = st.get("pd_decode_requests", 0) + len(handles)
            st["pd_decode_s"] = st.get("pd_decode_s", 0.0) + dt
            st["pd_kv_bytes_in"] = st.get("pd_kv_bytes_in", 0) + sum(h.kv_bytes for h in fresh)
            st["pd_reprefilled"] = st.get("pd_reprefilled", 0) + len(old)
            return [done[h.request["id"]] for h in handles]

    def _import_kv(self, b: "_Batch", live: list[int], handles: list[PrefillHandle]) -> None:
        """Left-pad the shipped per-request caches into one batch cache: rows = live requests."""
        from transformers import DynamicCache

        width = max(h.positions for h in handles)
        data = []
        for layer in range(len(handles[0].kv)):
            ks, vs = [], []
            for h in handles:
                k, v = h.kv[layer]
                pad = width - k.shape[-2]
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            data.append((torch.stack(ks), torch.stack(vs)))
        b.cache = DynamicCache(data, config=self.model.config)
        b.attn = torch.tensor([[0] * (width - h.positions) + [1] * h.positions for h in handles])
        b.pos = torch.tensor([[h.positions - 1] for h in handles])
        b.rows, b.expanded = list(live), True
        b.next_tok = torch.tensor([h.token_ids[-1] for h in handles])

    # -- the pieces -----------------------------------------------------------------------------
    def _start(self, reqs: list[dict], prompts: list[list[int]] | None = None) -> "_Batch":
        return _Batch(
            reqs,
            prompts if prompts is not None else [self.encode(r) for r in reqs],
            [self._trie(tuple(r["choices"])) if r.get("choices") else None for r in reqs],
            self.version,
        )

    def _prefill(self, b: "_Batch") -> torch.Tensor:
        """One forward over the unique prompts (identical prompts — a GRPO group's first turn, revisited
        states — are prefilled once and their KV cache fanned out later); returns one logits row per request."""
        pad = self.tokenizer.pad_token_id
        unique: dict[tuple, int] = {}
        b.row = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in b.prompts], dtype=torch.long)
        uprompts = [list(p) for p in unique]
        b.unique = len(uprompts)
        width = max(len(p) for p in uprompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in uprompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in uprompts])
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        b.cache = res.past_key_values
        b.attn, b.pos = attn[b.row], pos[b.row][:, -1:]
        b.rows, b.expanded = list(range(len(b.reqs))), False
        return res.logits[:, -1, :].float()[b.row]

    def _check_aborts(self, b: "_Batch") -> None:
        for i, r in enumerate(b.reqs):
            if b.finish[i] is None and r["id"] in self._aborted:
                b.finish[i] = "abort"

    def _first_token(self, b: "_Batch", logits: torch.Tensor) -> None:
        """Step 0: the first token of every request from the prefill's logits."""
        self._check_aborts(b)
        keep = [k for k, i in enumerate(b.rows) if b.finish[i] is None]
        if len(keep) < len(b.rows):  # aborted before the first token: drop their rows
            sel = torch.tensor(keep, dtype=torch.long)
            b.rows, logits, b.attn, b.pos = [b.rows[k] for k in keep], logits[sel], b.attn[sel], b.pos[sel]
        if keep:
            self._sample(b, logits)

    def _decode(self, b: "_Batch") -> None:
        """Steps 1…: one forward per token for the live rows. rows[k] = the request decoded in row k of
        attn / pos / next_tok (and of the cache once expanded). Finished requests leave the batch, so a
        long request (code, 48 tokens) does not make the short ones beside it pay for its decode steps."""
        while True:
            self._check_aborts(b)
            keep = [k for k, i in enumerate(b.rows) if b.finish[i] is None]
            if not keep:
                return
            sel = torch.tensor(keep, dtype=torch.long)
            if not b.expanded:  # fan the shared prefill out to one cache row per live request
                b.cache.reorder_cache(b.row[[b.rows[k] for k in keep]])
                b.expanded = True
            elif len(keep) < len(b.rows):
                b.cache.reorder_cache(sel)
            b.rows = [b.rows[k] for k in keep]
            b.attn = torch.cat([b.attn[sel], torch.ones(len(b.rows), 1, dtype=b.attn.dtype)], dim=-1)
            b.pos = b.pos[sel] + 1
            res = self.model(
                input_ids=b.next_tok[sel].unsqueeze(-1), attention_mask=b.attn, position_ids=b.pos, past_key_values=b.cache, use_cache=True
            )
            self._sample(b, res.logits[:, -1, :].float())

    def _sample(self, b: "_Batch", logits: torch.Tensor) -> None:
        """One token for every row of ``logits`` (rows = b.rows): choices mask, temperature, greedy or sampled."""
        eos = self.tokenizer.eos_token_id
        mask = torch.zeros_like(logits, dtype=torch.bool)
        for k, i in enumerate(b.rows):
            if b.tries[i] is not None:
                mask[k, ChoiceTrie.allowed(b.nodes[i])] = True
            else:
                mask[k] = True
        t = b.temps[b.rows]
        g = b.greedy[b.rows]
        scaled = logits / torch.where(g, torch.ones_like(t), t).unsqueeze(-1)
        logp = torch.log_softmax(scaled.masked_fill(~mask, float("-inf")), -1)
        safe = torch.where(mask.any(-1, keepdim=True), logp.exp(), torch.ones_like(logp))
        sampled = torch.multinomial(safe, 1, generator=self.generator).squeeze(-1)
        for k, i in enumerate(b.rows):  # a seeded request (rollout.deterministic): each token from its own generator
            if b.seeds[i] is not None and not g[k]:
                place = len(b.reqs[i].get("prefix_ids") or ()) + len(b.tokens[i])
                own = torch.Generator().manual_seed(mixed_seed(b.seeds[i], place))
                sampled[k] = torch.multinomial(safe[k], 1, generator=own)[0]
        b.next_tok = torch.where(g, logp.argmax(-1), sampled)
        for k, i in enumerate(b.rows):
            tok = int(b.next_tok[k])
            b.tokens[i].append(tok)
            b.logps[i].append(float(logp[k, tok]))
            if b.tries[i] is not None:
                b.allowed_log[i].append(ChoiceTrie.allowed(b.nodes[i]))
                b.nodes[i] = b.nodes[i][tok]
                if ChoiceTrie.finished(b.nodes[i]):
                    b.finish[i] = "stop"
            elif tok == eos or self.stopped(b.reqs[i], b.tokens[i]):
                b.finish[i] = "stop"
            if b.finish[i] is None and len(b.tokens[i]) >= b.limits[i]:
                b.finish[i] = "length"

    def _finish(self, b: "_Batch", t0: float, count_busy: bool = True) -> list[Completion]:
        for r in b.reqs:
            self._aborted.discard(r["id"])
        done = []
        for i, r in enumerate(b.reqs):  # an aborted request returns what it generated: a continuation goes on from it
            ok = b.finish[i] != "abort"
            done.append(
                Completion(
                    request_id=r["id"],
                    prompt_ids=b.prompts[i],
                    token_ids=b.tokens[i],
                    logprobs=b.logps[i],
                    allowed_ids=b.allowed_log[i],
                    text=self.response_text(r, b.tokens[i]) if ok else "",
                    finish_reason=b.finish[i] or "length",
                    version=b.version,
                )
            )
        self.stats["tokens"] += sum(len(c.token_ids) for c in done)
        self.stats["requests"] += len(b.reqs)
        if b.unique is not None:
            self.stats["prefill_rows_saved"] = self.stats.get("prefill_rows_saved", 0) + len(b.reqs) - b.unique
        if count_busy:
            self.stats["busy_s"] += time.perf_counter() - t0
        return done


class _Batch:
    """The decoding state of requests decoded together (one engine call)."""

    def __init__(self, reqs: list[dict], prompts: list[list[int]], tries: list, version: int):
        n = len(reqs)
        self.reqs, self.prompts, self.tries, self.version = reqs, prompts, tries, version
        self.nodes = [t.root if t else None for t in tries]
        for i, r in enumerate(reqs):  # a continued request's choice is already partly decoded
            for tok in r.get("prefix_ids") or ():
                if self.nodes[i] is not None:
                    self.nodes[i] = self.nodes[i][tok]
        self.limits = [int(r.get("max_tokens", 16)) for r in reqs]
        self.temps = torch.tensor([float(r.get("temperature", 1.0)) for r in reqs])
        self.greedy = self.temps <= 0
        self.seeds: list[int | None] = [r.get("seed") for r in reqs]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logps: list[list[float]] = [[] for _ in range(n)]
        self.allowed_log = [[] if t else None for t in tries]
        self.finish: list[str | None] = [None] * n
        self.rows: list[int] = []  # the request decoded in each row of attn / pos / next_tok (and of the cache once expanded)
        self.row: torch.Tensor | None = None  # request → its unique-prompt row of the (not yet expanded) prefill cache
        self.unique: int | None = None  # unique prompts prefilled (None: the cache came from elsewhere)
        self.cache = self.attn = self.pos = None
        self.expanded = False
        self.next_tok = torch.empty(0, dtype=torch.long)
