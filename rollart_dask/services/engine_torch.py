"""Torch inference engine: batched generation with a KV cache on a transformers causal LM.

Contract: ``generate(requests) -> completions`` (token ids, per-token log-probs, finish
reason, policy version), ``abort(ids)``, ``update_weights(version, weights)``,
``reset_prefix_cache()``. Requests that arrive together are decoded as one batch
(left-padded, one forward per token for the whole batch). Constrained decoding restricts
each step to the token ids that continue one of the request's ``choices``.
"""
from __future__ import annotations

import functools
import threading
import time

import torch

from ..types import Completion
from .encoding import ChoiceTrie, choice_trie
from .engine_base import EngineBase


class TorchEngine(EngineBase):
    def __init__(self, model_dir: str, seed: int = 0, max_batch: int = 1024):
        from transformers import AutoModelForCausalLM

        from ..models.tiny import load_tokenizer

        super().__init__(load_tokenizer(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.max_batch = max_batch
        self.generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # one batch or one weight swap at a time
        self._prefix_cache: dict = {}  # prompts are short here; kept for the contract

    # -- contract ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        n = len(self._prefix_cache)
        self._prefix_cache.clear()
        return n

    def update_weights(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        with self._lock:
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
        """Decode a batch together. Identical prompts (a GRPO group's first turn, revisited
        states) are prefilled once and their KV cache fanned out to every request."""
        with self._lock:
            t0 = time.perf_counter()
            version, n = self.version, len(reqs)
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            prompts = [self.encode(r) for r in reqs]
            unique: dict[tuple, int] = {}
            row = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts])
            uprompts = [list(p) for p in unique]
            width = max(len(p) for p in uprompts)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in uprompts])
            attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in uprompts])
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            tries = [self._trie(tuple(r["choices"])) if r.get("choices") else None for r in reqs]
            nodes = [t.root if t else None for t in tries]
            limits = [int(r.get("max_tokens", 16)) for r in reqs]
            temps = torch.tensor([float(r.get("temperature", 1.0)) for r in reqs])
            greedy = temps <= 0
            tokens: list[list[int]] = [[] for _ in range(n)]
            logps: list[list[float]] = [[] for _ in range(n)]
            allowed_log = [[] if t else None for t in tries]
            finish: list[str | None] = [None] * n
            res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)  # prefill, unique prompts
            cache = res.past_key_values
            logits = res.logits[:, -1, :].float()[row]
            attn, pos = attn[row], pos[row][:, -1:]
            # rows[k] = the request decoded in row k of logits / attn / pos / next_tok (and of the
            # cache once expanded). Finished requests leave the batch, so a long request (code,
            # 48 tokens) no longer makes the short ones beside it (one-token actions) pay for
            # every one of its decode steps.
            rows = list(range(n))
            expanded = False
            next_tok = torch.empty(0, dtype=torch.long)  # set by step 0, fed back from step 1 on
            for step in range(max(limits)):
                for i, r in enumerate(reqs):
                    if finish[i] is None and r["id"] in self._aborted:
                        finish[i] = "abort"
                keep = [k for k, i in enumerate(rows) if finish[i] is None]
                if not keep:
                    break
                if step > 0:
                    sel = torch.tensor(keep)
                    if not expanded:  # fan the shared prefill out to one cache row per live request
                        cache.reorder_cache(row[[rows[k] for k in keep]])
                        expanded = True
                    elif len(keep) < len(rows):
                        cache.reorder_cache(sel)
                    rows = [rows[k] for k in keep]
                    attn = torch.cat([attn[sel], torch.ones(len(rows), 1, dtype=attn.dtype)], dim=-1)
                    pos = pos[sel] + 1
                    res = self.model(input_ids=next_tok[sel].unsqueeze(-1), attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
                    logits = res.logits[:, -1, :].float()
                elif len(keep) < len(rows):  # aborted before the first token: drop their rows
                    sel = torch.tensor(keep)
                    rows, logits, attn, pos = [rows[k] for k in keep], logits[sel], attn[sel], pos[sel]
                mask = torch.zeros_like(logits, dtype=torch.bool)
                for k, i in enumerate(rows):
                    if tries[i] is not None:
                        mask[k, ChoiceTrie.allowed(nodes[i])] = True
                    else:
                        mask[k] = True
                t = temps[rows]
                g = greedy[rows]
                scaled = logits / torch.where(g, torch.ones_like(t), t).unsqueeze(-1)
                logp = torch.log_softmax(scaled.masked_fill(~mask, float("-inf")), -1)
                safe = torch.where(mask.any(-1, keepdim=True), logp.exp(), torch.ones_like(logp))
                sampled = torch.multinomial(safe, 1, generator=self.generator).squeeze(-1)
                next_tok = torch.where(g, logp.argmax(-1), sampled)
                for k, i in enumerate(rows):
                    tok = int(next_tok[k])
                    tokens[i].append(tok)
                    logps[i].append(float(logp[k, tok]))
                    if tries[i] is not None:
                        allowed_log[i].append(ChoiceTrie.allowed(nodes[i]))
                        nodes[i] = nodes[i][tok]
                        if ChoiceTrie.finished(nodes[i]):
                            finish[i] = "stop"
                    elif tok == eos:
                        finish[i] = "stop"
                    if finish[i] is None and len(tokens[i]) >= limits[i]:
                        finish[i] = "length"
            for r in reqs:
                self._aborted.discard(r["id"])
            done = []
            for i, r in enumerate(reqs):
                ok = finish[i] != "abort"
                done.append(Completion(
                    request_id=r["id"], prompt_ids=prompts[i], token_ids=tokens[i] if ok else [], logprobs=logps[i] if ok else [],
                    allowed_ids=allowed_log[i] if ok else None, text=self.tokenizer.decode(tokens[i], skip_special_tokens=True) if ok else "",
                    finish_reason=finish[i] or "length", version=version))
            self.stats["tokens"] += sum(len(c.token_ids) for c in done)
            self.stats["requests"] += n
            self.stats["prefill_rows_saved"] = self.stats.get("prefill_rows_saved", 0) + n - len(uprompts)
            self.stats["busy_s"] += time.perf_counter() - t0
            return done
