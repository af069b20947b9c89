"""``Registry``: named choices a flow key selects (engine and trainer backends, advantages, losses).

Imports nothing from the runtime, so both ``algo/`` and ``data/`` build on it. An entry is the
object itself or a lazy ``"module:attr"`` string, imported on first ``get``: heavy or optional
dependencies (vllm, megatron-core, the emulation tool) load only where they are chosen.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterator


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
            raise ValueError(f"{self.kind} {name!r} is already registered (to {self._describe(self._entries[name])}); "
                             "choose another name")
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
            module, _, attr = target.partition(":")
            target = self._entries[name] = getattr(importlib.import_module(module), attr)
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

