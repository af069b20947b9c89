"""WorkerPlugins that hold the services, and the thin task functions that reach them.

A plugin is registered on every worker and builds its service only where the worker's pool
tags say it belongs, so a restarted (or newly joined) worker gets its service back.
Batch task functions take a list of items and answer per item ("ok", value) or
("err", message): one bad item never fails its neighbours.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
import traceback

from distributed import WorkerPlugin, get_worker

log = logging.getLogger("rollart_dask")

ENGINE, ENVHOST, REWARD, TRAINER = "rollart-engine", "rollart-envhost", "rollart-reward", "rollart-trainer"


def _set_torch_threads():
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


class ServicePlugin(WorkerPlugin):
    """Builds one service in the workers whose resources match ``pools`` (and none of ``exclude``)."""

    kind = ""

    def __init__(self, pools: list[str], exclude: list[str] | None = None, **spec):
        self.pools, self.exclude, self.spec = list(pools), list(exclude or []), spec
        self.service = None

    def applies(self, worker) -> bool:
        res = worker.state.total_resources
        return any(p in res for p in self.pools) and not any(p in res for p in self.exclude)

    async def setup(self, worker):
        if not self.applies(worker):
            return
        try:  # heavy imports and model loads off the event loop (see PLATFORM.md)
            self.service = await asyncio.to_thread(self.build)
        except Exception:
            log.error("rollart %s failed to start on %s:\n%s", self.kind, worker.name, traceback.format_exc())
            raise

    def teardown(self, worker):
        self.service = None

    def build(self):
        raise NotImplementedError


class EnginePlugin(ServicePlugin):
    kind = "engine"
    name = ENGINE

    async def setup(self, worker):
        self.tags = set(worker.state.total_resources)
        await super().setup(worker)

    def build(self):
        if self.spec.get("backend") == "emulated":
            return _emulated_engine(self.spec["emulation"], getattr(self, "tags", set()), self.spec.get("seed", 0))
        _set_torch_threads()
        kw = {"seed": self.spec.get("seed", 0), "max_batch": self.spec.get("max_batch", 1024)}
        if self.spec.get("backend") == "vllm":
            from .engine_vllm import VLLMEngine

            gpu = {k: self.spec[k] for k in ("gpu_memory_utilization", "sleep_level") if k in self.spec}  # used on GPU builds only
            return VLLMEngine(self.spec["model_dir"], **kw, **gpu)
        from .engine_torch import TorchEngine

        return TorchEngine(self.spec["model_dir"], **kw)


def _emulated_engine(emulation: dict, tags: set, seed: int):
    """EMULATED: the instances this worker's pool stands for (emulation.pools[pool]: gpus / tp of them)."""
    from ..emulation import GPUS, MODELS
    from ..emulation.engine import EmulatedInstances

    pool = next((p for p in ("H800", "H20") if p in tags), None)
    spec = emulation["pools"].get(pool)
    if spec is None or spec["gpus"] == 0:
        raise RuntimeError(f"emulation.pools has no GPUs for pool {pool}, which this flow generates on")
    kw = {"kv_link_gbps": emulation["kv_link_gbps"]} if "kv_link_gbps" in emulation else {}  # ASSUMED link of rollout.pd
    return EmulatedInstances(spec["gpus"] // spec["tp"], **kw, model=MODELS[emulation["model"]], gpu=GPUS[spec["gpu"]], tp=spec["tp"],
                             time_scale=emulation["time_scale"], seed=seed)


class EnvHostPlugin(ServicePlugin):
    kind = "envhost"
    name = ENVHOST

    def build(self):
        from .envhost import EnvHost

        return EnvHost()


class RewardPlugin(ServicePlugin):
    """The reward runner on the reward pool's workers; when the flow has stateful rewards (a judge),
    also on the REWARD pool's workers, which host them in either mode."""

    kind = "reward"
    name = REWARD

    def applies(self, worker) -> bool:
        return super().applies(worker) or (bool(self.spec.get("stateful")) and "REWARD" in worker.state.total_resources)

    async def setup(self, worker):
        self.tags = set(worker.state.total_resources)
        await super().setup(worker)

    def build(self):
        from .reward_runner import RewardRunner

        tags = getattr(self, "tags", set())
        mode = self.spec.get("mode", "local")
        local = mode == "local" or "REWARD" in tags
        if local and self.spec.get("stateful"):
            _set_torch_threads()  # this runner loads a judge engine
        return RewardRunner(**self.spec, local=local, caller=mode == "serverless" and "SERVERLESS" in tags)


class TrainerPlugin(ServicePlugin):
    kind = "trainer"
    name = TRAINER

    def build(self):
        emulation = self.spec.get("emulation")
        if emulation is not None:  # EMULATED: profile step time around the real protocol
            from ..emulation import GPUS, MODELS
            from ..emulation.trainer import EmulatedTrainer

            t = emulation["trainer"]
            return EmulatedTrainer(MODELS[emulation["model"]], gpus=t["gpus"], gpu=GPUS[t["gpu"]], time_scale=emulation["time_scale"])
        _set_torch_threads()
        spec = dict(self.spec)
        backend, parallel = spec.pop("backend", "torch"), spec.pop("megatron", None) or {}
        if backend == "megatron":  # trainer.backend=megatron: a megatron-core GPTModel, HF weights in and out
            from .trainer_megatron import MegatronTrainer

            return MegatronTrainer(**spec, **parallel)
        from .trainer import TorchTrainer

        return TorchTrainer(**spec)


def service(name: str, worker=None):
    worker = worker or get_worker()
    plugin = worker.plugins.get(name)
    if plugin is None or plugin.service is None:
        raise RuntimeError(f"no {name} service on worker {worker.name} (resources {dict(worker.state.total_resources)})")
    return plugin.service


def _per_item(fn, items: list, map_=map) -> list:
    def one(item):
        try:
            return ("ok", fn(item))
        except Exception as e:  # reported per item; the control plane decides retry/fail
            return ("err", f"{type(e).__name__}: {e}")

    return list(map_(one, items))


# -- thin tasks ----------------------------------------------------------------------------
def generate_batch(items: list[dict]) -> list:
    try:
        return [("ok", c) for c in service(ENGINE).generate(items)]
    except Exception as e:
        return [("err", f"{type(e).__name__}: {e}")] * len(items)


def reward_batch(items: list[dict]) -> list:
    """Plain rewards per item (concurrent Lambda invocations when serverless); stateful ones (a
    judge: the control plane sends them to the REWARD pool) as one batched generation."""
    runner = service(REWARD)
    out: list = [None] * len(items)
    stateful = [runner.is_stateful(item["reward"]) for item in items]
    judged = [i for i, s in enumerate(stateful) if s]
    plain = [i for i, s in enumerate(stateful) if not s]
    for i, r in zip(plain, _per_item(runner.score, [items[i] for i in plain], runner.map)):
        out[i] = r
    for i, r in zip(judged, runner.score_stateful([items[i] for i in judged]) if judged else []):
        out[i] = r
    return out


# -- streamed tasks: start the items, answer each on the caller's topic as soon as it is done ---------
_outbox: dict[tuple, list] = {}  # (worker address, topic) → answers not yet sent
_outbox_lock = threading.Lock()


def _answer(worker, topic: str, item: dict, result: tuple) -> None:
    """Queue one answer; answers finished by the same event-loop tick leave as one event (one scheduler
    message for many calls, not one each). Pickled: events must be msgpack."""
    key = (worker.address, topic)
    with _outbox_lock:
        pending = _outbox.setdefault(key, [])
        pending.append((item["_cid"], pickle.dumps(result)))
        first = len(pending) == 1
    if first:
        worker.loop.add_callback(_flush, worker, key)  # thread-safe; runs on the worker's event loop


def _flush(worker, key: tuple) -> None:
    with _outbox_lock:
        answers = _outbox.pop(key, [])
    if answers:
        worker.log_event(key[1], answers)


def _start(fn, items: list[dict], topic: str, executor) -> int:
    worker = get_worker()

    def one(item):
        try:
            result = ("ok", fn(item))
        except Exception as e:  # reported per item; the control plane decides retry/fail
            result = ("err", f"{type(e).__name__}: {e}")
        _answer(worker, topic, item, result)

    for item in items:
        executor.submit(one, item)
    return len(items)


def env_reset_stream(items: list[dict], topic: str) -> int:
    host = service(ENVHOST)
    return _start(host.reset, items, topic, host.pool)


def env_step_stream(items: list[dict], topic: str) -> int:
    host = service(ENVHOST)
    return _start(host.step, items, topic, host.pool)


def generate_stream(items: list[dict], topic: str) -> int:
    """For engines that batch continuously across calls (the emulated one): each request joins the
    running batch at once and is answered when it finishes, not when its call's slowest does."""
    engine = service(ENGINE)
    return _start(lambda item: engine.generate([item])[0], items, topic, engine.pool)


async def engine_abort(request_ids: list[str]) -> int:
    return service(ENGINE).abort(request_ids)  # on the event loop: never waits for a free thread


def engine_reset_prefix_cache() -> int:
    return service(ENGINE).reset_prefix_cache()


def trainer_step(samples: list[dict], _after=None) -> dict:
    return service(TRAINER).train_step(samples)


def trainer_warm_start(demos: list[dict], steps: int, batch: int, lr: float, seed: int, shares: dict | None) -> dict:
    return service(TRAINER).warm_start(demos, steps, batch, lr, seed, shares)


def env_expert_demos(item: dict) -> list[dict]:
    from .envhost import expert_demos

    return expert_demos(item)


def trainer_checkpoint(path: str, _after=None) -> str:
    return service(TRAINER).save_checkpoint(path)


def trainer_restore(path: str) -> int:
    return service(TRAINER).restore(path)


def service_stats(dask_worker=None) -> dict:
    """Per-service counters of this worker (called through client.run)."""
    out = {}
    for name in (ENGINE, ENVHOST, REWARD):
        plugin = dask_worker.plugins.get(name)
        if plugin is not None and plugin.service is not None:
            out[name] = dict(plugin.service.stats)
    return out


def env_close_batch(items: list[dict]) -> list:
    return _per_item(lambda item: service(ENVHOST).close(item["traj_id"]), items)
