"""Named choices: ``Registry`` (name → object or lazy ``"module:attr"`` string), the mechanism, and the registries of
envs and rewards built on it; the runtime's other registries (engine and trainer backends, advantages, losses) are
``Registry`` objects beside what they choose from.

Imports nothing from the runtime, so ``algo/``, ``data/`` and a reward's Lambda zip build on it. An entry is the
object itself or a lazy ``"module:attr"`` string, imported on first ``get``: heavy or optional dependencies (vllm,
megatron-core, the emulation) load only where they are chosen, and workers import an env or reward the client need
not. Any ``"module:attr"`` string works as a name too, so a flow can point at user code the workers can import;
``register_env()`` / ``register_reward()`` add names in the current process (a name already taken is an error), and
installed packages add theirs through entry points.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

# This project's envs/ and rewards/ folders installed as top-level packages until 2026-12-06; their old names
# ("envs.frozenlake:FrozenLakeText") still resolve, with a warning that gives the new one.
RENAMED = {"envs": "rollart_dask.envs", "rewards": "rollart_dask.rewards"}


@functools.lru_cache(maxsize=None)
def current_module_name(module: str) -> str:
    """An old name of this project's envs or rewards → the name it installs under now; any other module as it is.
    A user's own top-level ``envs`` or ``rewards`` package wins: a name inside it is theirs."""
    top, dot, rest = module.partition(".")
    if top not in RENAMED:
        return module
    old = importlib.util.find_spec(top)
    if old is not None and old.origin != importlib.util.find_spec(RENAMED[top]).origin:
        return module
    new = RENAMED[top] + dot + rest
    warnings.warn(
        f"{module!r} is an old name: this project's {top} install as {RENAMED[top]} now; write {new!r}", FutureWarning, stacklevel=3
    )
    return new


def import_target(target: str) -> Any:
    """The object a ``"module:attr"`` string names (old names of this project's envs and rewards included)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(current_module_name(module)), attr)


class UnknownName(KeyError):
    """A name the registry does not hold; the message lists the names it does."""

    def __str__(self) -> str:  # KeyError's own str() would quote the whole message
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str, entries: dict[str, Any] | None = None):
        self.kind = kind  # what a name names ("engine backend", "loss"): used in error messages
        self._entries: dict[str, Any] = {}
        for name, target in (entries or {}).items():
            self.register(name, target)

    def register(self, name: str, target: Any = None):
        """Add ``name`` → ``target`` (an object or a lazy ``"module:attr"``). Without ``target``, a decorator."""
        if target is None:

            def deco(obj):
                self.register(name, obj)
                return obj

            return deco
        if name in self._entries and self._describe(self._entries[name]) != self._describe(target):
            # (the same origin again is a module imported twice, e.g. reloaded: it replaces itself)
            raise ValueError(f"{self.kind} {name!r} is already registered (to {self._describe(self._entries[name])}); choose another name")
        if isinstance(target, str) and ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: a lazy entry is 'module:attr', got {target!r}")
        self._entries[name] = target
        return target

    def check(self, name: str) -> str:
        """``name`` if registered, else the error ``get`` would raise (nothing is imported)."""
        if name not in self._entries:
            raise UnknownName(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}")
        return name

    def peek(self, name: str) -> Any:
        """The entry as registered: the object, or its lazy "module:attr" when not yet imported."""
        return self._entries[self.check(name)]

    def get(self, name: str) -> Any:
        target = self._entries[self.check(name)]
        if isinstance(target, str):  # resolved once: later calls get the object itself
            target = self._entries[name] = import_target(target)
        return target

    __getitem__ = get

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> dict[str, str]:
        """name → "module:attr", importing nothing (a resolved entry is described by its origin)."""
        return {n: t if isinstance(t, str) else self._describe(t) for n, t in sorted(self._entries.items())}

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

    @staticmethod
    def _describe(target: Any) -> str:
        if isinstance(target, str):
            return target
        return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


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
