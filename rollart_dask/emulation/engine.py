"""Emulated inference engine: the engine contract of the real backends, with timing from a
hardware profile instead of a model. Labelled ``emulated`` everywhere it reports.

Three parts: ``batch`` (``ContinuousBatch``, the pure, clock-free timing model of one instance),
``instance`` (``EmulatedEngine``, one instance: the batch driven against the wall clock) and this
module's ``EmulatedInstances``, the engine a worker holds when it stands for several instances.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rollart_dask.emulation.batch import BLOCK, ContinuousBatch, Seq, block_hashes
from rollart_dask.emulation.hardware import GPUS, MODELS, weight_transfer_seconds
from rollart_dask.emulation.instance import EmulatedEngine
from rollart_dask.types import Completion

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig

__all__ = ["BLOCK", "ContinuousBatch", "EmulatedEngine", "EmulatedInstances", "Seq", "block_hashes"]


class EmulatedInstances:
    """The engine of one worker when it stands for several instances (``gpus / tp`` of them): each
    instance has its own batch, KV and driver; a trajectory sticks to the instance it first went to
    (its prefix cache lives there), new ones go to the least-loaded. Same contract as one engine."""

    label = "emulated"
    pool: ThreadPoolExecutor  # streamed generation: one waiting thread per request in flight (requests only wait on events)

    def __init__(self, instances: int, **kwargs):
        if instances < 1:
            raise ValueError(f"an emulated engine worker needs at least one instance, got {instances}")
        self.engines = [EmulatedEngine(**dict(kwargs, seed=kwargs.get("seed", 0) * 1000 + i)) for i in range(instances)]
        self.pool = ThreadPoolExecutor(4096, thread_name_prefix="emulated-request")
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._load = [0] * instances
        self._lock = threading.Lock()

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
    ) -> EmulatedInstances:  # (lora: never, the flow refuses it)
        """The instances the worker's ``pool`` stands for (``emulation.pools[pool]``: gpus / tp of them)."""
        if emulation is None:
            raise ValueError("engine.backend=emulated needs the flow's emulation section")
        spec = emulation.pools.get(pool)
        if spec is None or spec.gpus == 0:
            raise RuntimeError(f"emulation.pools has no GPUs for pool {pool}, which this flow generates on")
        engine = cls(
            spec.gpus // spec.tp,
            model=MODELS[emulation.model],
            gpu=GPUS[spec.gpu],
            tp=spec.tp,
            time_scale=emulation.time_scale,
            seed=seed,
            kv_link_gbps=emulation.kv_link_gbps,
        )  # kv_link_gbps: the ASSUMED link of rollout.pd
        engine.emulation = emulation
        return engine

    emulation: EmulationConfig | None = None

    def emulated_pull_s(self, spec: dict) -> float:
        """Wall seconds a weight pull takes on this worker: the cross-cluster transfer of the profile's weights
        (``hardware.weight_transfer_seconds``) for ``spec['pull']``, the generation GPUs of every engine worker the
        version goes to (``spec['engine_pools']``, one entry each) and the trainer's, × time_scale. 0 unconfigured."""
        e = self.emulation
        if e is None or not spec.get("engine_pools"):
            return 0.0
        gen = sum(e.pools[p].gpus for p in spec["engine_pools"] if p in e.pools)
        return (
            weight_transfer_seconds(MODELS[e.model], gen, e.trainer.gpus, e.weight_link_gbps, spec.get("pull", "background")) * e.time_scale
        )

    @property
    def version(self) -> int:
        return self.engines[0].version

    @property
    def stats(self) -> dict:
        """Counters summed over instances; busy seconds averaged, so a pool's busy fraction stays in [0, 1]."""
        out = dict(self.engines[0].stats)
        for key in (
            "tokens",
            "requests",
            "prefill_tokens",
            "cached_tokens",
            "decode_steps",
            "weight_loads",
            "request_s",
            "imported_tokens",
            *{k for e in self.engines for k in e.stats if k.startswith("pd_")},
        ):
            out[key] = sum(e.stats.get(key, 0) for e in self.engines)
        for key in ("busy_s", "emulated_busy_s"):
            out[key] = sum(e.stats[key] for e in self.engines) / len(self.engines)
        out["instances"] = len(self.engines)
        return out

    def _instance(self, r: dict) -> int:
        key = str((r.get("emulate") or {}).get("stream") or str(r["id"]).split("#")[0])
        with self._lock:
            i = self._sticky.get(key)
            if i is None:
                i = min(range(len(self.engines)), key=self._load.__getitem__)
                self._sticky[key] = i
                while len(self._sticky) > 100_000:  # forget the oldest trajectories
                    self._sticky.popitem(last=False)
            self._load[i] += 1
            return i

    def generate(self, requests: list[dict]) -> list[Completion]:
        return self._fan("generate", requests, requests)

    def prefill(self, requests: list[dict]) -> list:
        """Prefill/decode disaggregation, modelled (EmulatedEngine.prefill) on the instance each request sticks to."""
        return self._fan("prefill", requests, requests)

    def decode_from_prefill(self, handles: list, stale: str = "reprefill") -> list[Completion]:
        return self._fan("decode_from_prefill", handles, [h.request for h in handles], stale=stale)

    def _fan(self, method: str, items: list, requests: list[dict], **kw) -> list:
        """``method`` of the instances, each on the items whose trajectory sticks to it, concurrently."""
        by: dict[int, list[int]] = collections.defaultdict(list)
        for j, r in enumerate(requests):
            by[self._instance(r)].append(j)
        out: list = [None] * len(requests)
        threads = []

        def run(i: int, idx: list[int]) -> None:
            try:
                for j, c in zip(idx, getattr(self.engines[i], method)([items[j] for j in idx], **kw)):
                    out[j] = c
            finally:
                with self._lock:
                    self._load[i] -= len(idx)

        if len(by) == 1:  # one instance (a streamed request): no thread to start
            ((i, idx),) = by.items()
            run(i, idx)
            return out
        for i, idx in by.items():  # instances decode concurrently, as separate GPUs do
            t = threading.Thread(target=run, args=(i, idx), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        if any(c is None for c in out):
            raise RuntimeError("an emulated instance failed to answer (see the worker log)")
        return out

    def abort(self, request_ids: list[str]) -> int:
        by: dict[int, list[str]] = collections.defaultdict(list)
        with self._lock:
            for rid in request_ids:
                i = self._sticky.get(rid.split("#")[0])
                for j in [i] if i is not None else range(len(self.engines)):
                    by[j].append(rid)
        for i, rids in by.items():
            self.engines[i].abort(rids)
        return len(request_ids)

    def update_weights(self, version: int, weights=None) -> int:
        threads = [threading.Thread(target=e.update_weights, args=(version, weights), daemon=True) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return version

    def reset_prefix_cache(self) -> int:
        return sum(e.reset_prefix_cache() for e in self.engines)
