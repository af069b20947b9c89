"""Name → factory registries for envs and rewards.

Built-ins are 'module:attr' strings imported lazily (workers import them, the client need not).
Any 'module:attr' string works as a name too, so a flow can point at user code that workers
can import; `register()` adds names in the current process.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

ENVS: dict[str, Any] = {
    "frozenlake": "envs.frozenlake:FrozenLakeText",
    "sokoban": "envs.sokoban:SokobanText",
    "math": "envs.reasoning:MathEnv",
    "code": "envs.code_sandbox:CodeSandboxEnv",
    "gym": "envs.adapters:GymnasiumText",
    "textarena": "envs.adapters:TextArenaEnv",
}
REWARDS: dict[str, Any] = {
    "frozenlake": "rewards.frozenlake:reward",
    "sokoban": "rewards.sokoban:reward",
    "math": "rewards.reasoning:reward",
    "code": "rewards.code:reward",
    "env_return": "rewards.env_return:reward",
}


def register_env(name: str, factory: Callable | str) -> None:
    ENVS[name] = factory


def register_reward(name: str, fn: Callable | str) -> None:
    REWARDS[name] = fn


@functools.lru_cache(maxsize=None)  # scanning installed distributions costs milliseconds: once per process
def _entry_points(group: str) -> dict[str, str]:
    """Envs/rewards that other installed packages declare under the entry-point group."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=group)}


def env_names() -> dict[str, Any]:
    return {**_entry_points("rollart_dask.envs"), **ENVS}


def reward_names() -> dict[str, Any]:
    return {**_entry_points("rollart_dask.rewards"), **REWARDS}


def _resolve(kind: str, table: dict[str, Any], name: str) -> Any:
    table = {**_entry_points(f"rollart_dask.{kind}s"), **table}
    target = table.get(name, name if ":" in name else None)
    if target is None:
        raise KeyError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))} (or give 'module:attr')")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def make_env(name: str, **kwargs) -> Any:
    return _resolve("env", ENVS, name)(**kwargs)


def get_reward(name: str) -> Callable[[dict], Any]:
    return _resolve("reward", REWARDS, name)
