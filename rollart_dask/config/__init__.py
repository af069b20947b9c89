"""The flow's configuration, by job: ``schema`` (every key, its default and checks, and the one normalisation pass),
``loading`` (files, ``--set`` overrides, the user's imports, errors naming the key) and ``resolution`` (what a flow
resolves to on the machine and in the run: the engine backend, a task's engine pools)."""
from rollart_dask.config.loading import FlowError, apply_overrides, load_flow
from rollart_dask.config.resolution import PDNotSupported, check_pd_backend, resolve_engine_backend, task_pool, task_pools, vllm_is_cpu_build
from rollart_dask.config.schema import (
    Strict, WorkerSpec, SecurityConfig, SCHEDULER_SCHEMES, ClusterConfig, ModelConfig, EngineConfig, PROMPT_FIELDS,
    PromptConfig, TaskConfig, PDConfig, UserFaultsConfig, RolloutConfig, MegatronParallel, LoraConfig,
    TrainerConfig, WarmStartConfig, EndpointFaults, RewardConfig, MooncakeConfig, WeightsConfig, EmulatedPool,
    EmulatedTrainer, EmulationConfig, EvalConfig, PlacementConfig, WandbConfig, MlflowConfig, ObserveConfig,
    FlowConfig, normalise,
)

__all__ = [
    "FlowError", "apply_overrides", "load_flow", "PDNotSupported", "check_pd_backend", "resolve_engine_backend",
    "task_pool", "task_pools", "vllm_is_cpu_build", "Strict", "WorkerSpec", "SecurityConfig", "SCHEDULER_SCHEMES",
    "ClusterConfig", "ModelConfig", "EngineConfig", "PROMPT_FIELDS", "PromptConfig", "TaskConfig", "PDConfig",
    "UserFaultsConfig", "RolloutConfig", "MegatronParallel", "LoraConfig", "TrainerConfig", "WarmStartConfig",
    "EndpointFaults", "RewardConfig", "MooncakeConfig", "WeightsConfig", "EmulatedPool", "EmulatedTrainer",
    "EmulationConfig", "EvalConfig", "PlacementConfig", "WandbConfig", "MlflowConfig", "ObserveConfig",
    "FlowConfig", "normalise",
]
