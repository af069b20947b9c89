"""Name → factory registries for envs and rewards.

Built-ins are 'module:attr' strings imported lazily (workers import them, the client need not).
Any 'module:attr' string works as a name too, so a flow can point at user code that workers
can import; `register_env()` / `register_reward()` add names in the current process (a name
already taken is an error), and installed packages add theirs through entry points.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

from rollart_dask.registries import Registry, UnknownName, import_target

ENVS = Registry(
    "env",
    {
        "frozenlake": "rollart_dask.envs.frozenlake:FrozenLakeText",
        "sokoban": "rollart_dask.envs.sokoban:SokobanText",
        "math": "rollart_dask.envs.reasoning:MathEnv",
        "code": "rollart_dask.envs.code_sandbox:CodeSandboxEnv",
        "gym": "rollart_dask.envs.adapters:GymnasiumText",
        "textarena": "rollart_dask.envs.adapters:TextArenaEnv",
        "synthetic": "rollart_dask.envs.synthetic:SyntheticAgentEnv",  # EMULATED workload shape, for ablations on emulated hardware
    },
)
REWARDS = Registry(
    "reward",
    {
        "frozenlake": "rollart_dask.rewards.frozenlake:reward",
        "frozenlake-progress": "rollart_dask.rewards.frozenlake:progress",
        "sokoban": "rollart_dask.rewards.sokoban:reward",
        "math": "rollart_dask.rewards.reasoning:reward",
        "code": "rollart_dask.rewards.code:reward",
        "env_return": "rollart_dask.rewards.env_return:reward",
        "judge": "rollart_dask.rewards.judge:reward",  # stateful (NEEDS_ENGINE): runs on the REWARD pool, never as a Lambda function
        "emulated": "rollart_dask.rewards.emulated:reward",  # EMULATED reward cost (sleeps), with the synthetic env
    },
)
register_env = ENVS.register  # register_env(name, factory | "module:attr")
register_reward = REWARDS.register  # register_reward(name, fn | "module:attr")


_scan_lock = threading.Lock()


def _entry_points(group: str) -> dict[str, str]:
    # lru_cache alone lets the 64 env-host threads of a worker's first batch all scan at once
    with _scan_lock:
        return _scan_entry_points(group)


@functools.lru_cache(maxsize=None)  # scanning installed distributions costs ~0.1 s: once per process
def _scan_entry_points(group: str) -> dict[str, str]:
    """Envs/rewards that other installed packages declare under the entry-point group."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group=group)}


def env_names() -> dict[str, str]:
    return {**_entry_points("rollart_dask.envs"), **ENVS.entries()}


def reward_names() -> dict[str, str]:
    return {**_entry_points("rollart_dask.rewards"), **REWARDS.entries()}


def _resolve(kind: str, registry: Registry, name: str) -> Any:
    if name in registry:
        return registry.get(name)
    found = _entry_points(f"rollart_dask.{kind}s")
    target = found.get(name, name if ":" in name else None)
    if target is None:
        known = sorted({*found, *registry.names()})
        raise UnknownName(f"unknown {kind} {name!r}; registered: {', '.join(known)} (or give 'module:attr')")
    return import_target(target)


def make_env(name: str, **kwargs) -> Any:
    return _resolve("env", ENVS, name)(**kwargs)


def get_reward(name: str) -> Callable[[dict], Any]:
    return _resolve("reward", REWARDS, name)


def stateful_reward(name: str):
    """The module of a stateful reward, else None.

    A reward is stateful (needs an inference engine) when its module sets ``NEEDS_ENGINE = True``;
    the module then provides ``request(trajectory) -> dict`` (a generate request: chat
    ``messages``, ``choices``, ``max_tokens``, ``temperature``) and its reward function takes
    ``(trajectory, completion)``. Stateful rewards run on the REWARD pool, never serverless.
    """
    fn = get_reward(name)
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if not getattr(module, "NEEDS_ENGINE", False):
        return None
    if not callable(getattr(module, "request", None)):
        raise TypeError(f"reward {name!r}: its module {module.__name__} sets NEEDS_ENGINE but has no request(trajectory) function")
    return module
