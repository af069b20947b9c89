"""``Registry``: named choices a flow key selects (engine and trainer backends, advantages, losses).

Imports nothing from the runtime, so both ``algo/`` and ``data/`` build on it. An entry is the
object itself or a lazy ``"module:attr"`` string, imported on first ``get``: heavy or optional
dependencies (vllm, megatron-core, the emulation tool) load only where they are chosen.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from typing import Any, Iterator

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
