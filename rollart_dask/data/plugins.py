"""WorkerPlugins that hold the services (the thin tasks that reach them are in data/tasks.py).

A plugin is registered on every worker and builds its service only where the worker's pool
tags say it belongs, so a restarted (or newly joined) worker gets its service back.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from typing import TYPE_CHECKING

from distributed import WorkerPlugin

from rollart_dask.data.backends import ENGINES, TRAINERS, set_torch_threads

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig, FlowConfig, LoraConfig, TrainerConfig

log = logging.getLogger("rollart_dask")

ENGINE, ENVHOST, REWARD, TRAINER = "rollart-engine", "rollart-envhost", "rollart-reward", "rollart-trainer"


class ImportModules(WorkerPlugin):
    """Imports the flow's ``imports`` module names on every worker (installed there), so their decorators run."""

    name = "rollart-imports"

    def __init__(self, modules: list[str]):
        self.modules = list(modules)

    def setup(self, worker):
        import importlib

        for m in self.modules:
            importlib.import_module(m)  # a module missing on a worker fails the registration, naming it


def user_code(imports: list[str]) -> list[tuple[str, WorkerPlugin]]:
    """(name, plugin) for the flow's ``imports`` (rollart_dask/usercode.py): each file is shipped to every worker, a
    later one included, and imported there under its stem (distributed's UploadFile); module names are imported."""
    from distributed.diagnostics.plugin import UploadFile

    from rollart_dask.usercode import module_name

    found = [(f"rollart-user-{module_name(i)}", UploadFile(i)) for i in imports if i.endswith(".py")]
    modules = [i for i in imports if not i.endswith(".py")]
    return found + ([(ImportModules.name, ImportModules(modules))] if modules else [])


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
    """The engine of ``backend`` (data/backends.py ENGINES), built from the flow's engine section."""

    kind = "engine"
    name = ENGINE

    def __init__(
        self,
        pools: list[str],
        exclude: list[str] | None = None,
        *,
        backend: str,
        engine: EngineConfig,
        model_dir: str,
        seed: int = 0,
        emulation: EmulationConfig | None = None,
        lora: LoraConfig | None = None,
    ):
        super().__init__(pools, exclude)
        self.backend = ENGINES.check(backend)  # an unknown name fails in the client, not in every worker
        self.engine, self.model_dir, self.seed, self.emulation, self.lora = engine, model_dir, seed, emulation, lora
        self.pool: str | None = None

    async def setup(self, worker):
        self.pool = next((p for p in self.pools if p in worker.state.total_resources), None)  # the pool this worker serves
        await super().setup(worker)

    def build(self):
        return ENGINES.get(self.backend).from_config(
            self.engine,
            model_dir=self.model_dir,
            seed=self.seed,
            pool=self.pool,
            emulation=self.emulation,
            **({"lora": self.lora} if self.lora else {}),
        )


class EnvHostPlugin(ServicePlugin):
    kind = "envhost"
    name = ENVHOST

    def build(self):
        from rollart_dask.data.envhost import EnvHost

        return EnvHost(**self.spec)  # (threads: cluster.env_threads)


class RewardPlugin(ServicePlugin):
    """The reward runner on the reward pool's workers; when the flow has stateful rewards (a judge, or one
    declared stateless=False), also on the REWARD pool's workers, which host them in either mode."""

    kind = "reward"
    name = REWARD

    def applies(self, worker) -> bool:
        kept_local = self.spec.get("stateful") or self.spec.get("pinned")
        return super().applies(worker) or (bool(kept_local) and "REWARD" in worker.state.total_resources)

    async def setup(self, worker):
        self.tags = set(worker.state.total_resources)
        await super().setup(worker)

    def build(self):
        from rollart_dask.data.reward_runner import RewardRunner

        tags = getattr(self, "tags", set())
        mode = self.spec.get("mode", "local")
        local = mode == "local" or "REWARD" in tags
        if local and self.spec.get("stateful"):
            set_torch_threads()  # this runner loads a judge engine
        return RewardRunner(**self.spec, local=local, caller=mode == "serverless" and "SERVERLESS" in tags)


class TrainerPlugin(ServicePlugin):
    """The trainer of ``trainer.backend`` (data/backends.py TRAINERS) on the TRAIN worker."""

    kind = "trainer"
    name = TRAINER

    def __init__(
        self,
        pools: list[str],
        *,
        trainer: TrainerConfig,
        model_dir: str,
        seed: int = 0,
        temperature: float = 1.0,
        emulation: EmulationConfig | None = None,
    ):
        super().__init__(pools)
        TRAINERS.check(trainer.backend)
        self.trainer, self.model_dir, self.seed, self.temperature, self.emulation = trainer, model_dir, seed, temperature, emulation

    def build(self):
        return TRAINERS.get(self.trainer.backend).from_config(
            self.trainer, model_dir=self.model_dir, seed=self.seed, temperature=self.temperature, emulation=self.emulation
        )


# -- what Run's set-up registers ---------------------------------------------------------------------
def engine_plugin(cfg: FlowConfig, pools: list[str], model_dir: str, backend: str) -> EnginePlugin:
    """The engines of the flow on ``pools`` (never on the trainer's worker); ``backend``: engine.backend resolved (auto → torch/vllm)."""
    return EnginePlugin(
        pools,
        exclude=["TRAIN"],
        backend=backend,
        engine=cfg.engine,
        model_dir=model_dir,
        seed=cfg.seed,
        emulation=cfg.emulation if cfg.emulated else None,
        lora=cfg.trainer.lora,
    )


def trainer_plugin(cfg: FlowConfig, model_dir: str) -> TrainerPlugin:
    """The flow's trainer; it recomputes log-probs at the engines' sampling temperature."""
    return TrainerPlugin(
        ["TRAIN"],
        trainer=cfg.trainer,
        model_dir=model_dir,
        seed=cfg.seed,
        temperature=cfg.engine.temperature,
        emulation=cfg.emulation if cfg.emulated else None,
    )
