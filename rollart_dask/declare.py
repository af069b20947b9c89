"""The declarative API (the paper's programming model): a user's own env classes and reward functions
state where they run, in code.

    import rollart_dask

    @rollart_dask.env("grid-walk", affinity="decode")      # its generation goes to the H20 (decode) pool
    class GridWalk: ...                                      # reset(seed) / step(action) / close()

    @rollart_dask.reward("grid-walk", stateless=True)      # serverless mode: deployed and invoked as a Lambda function
    def score(trajectory: dict) -> dict: ...

Each decorator registers its object under the name (as ``register_env``/``register_reward`` do) and
records what it declares on it (``__rollart__``). A flow names the object by that name once the
module is imported (the flow key ``imports``: workers import it too), or as ``module:attr``. What a
decorator declares is the default of the equivalent flow key: a task's ``affinity`` set in the flow
wins over its env's. A reward declared ``stateless=False`` keeps state between calls: it is never
deployed as a function and runs on the REWARD pool in either ``reward.mode``.

This module imports only the registries (no Dask, no torch): a decorated reward's Lambda zip carries
it, and ``handler`` below is that function's handler.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from rollart_dask.registry import ENVS, REWARDS, Registry

AFFINITIES = ("prefill", "decode", "any", "auto")
TARGET_ENV = "ROLLART_REWARD"  # the Lambda function's environment: which 'module:attr' its handler calls


def _register(registry: Registry, name: str, obj: Any) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"@rollart_dask.{registry.kind}: the name must be a non-empty string without ':', got {name!r}")
    if getattr(obj, "__module__", None) == "__main__":
        raise ValueError(
            f"@rollart_dask.{registry.kind}({name!r}) on {obj.__qualname__}: declare it in an importable module "
            "(workers and Lambda functions import it by name), not in the script being run"
        )
    registry.register(name, obj)


def env(name: str, *, affinity: str | None = None) -> Callable:
    """Register an env class (or factory) as ``name``; ``affinity`` ('prefill' → H800, 'decode' → H20,
    'any', 'auto') is the default of ``tasks[].affinity`` for the tasks that use it."""
    if affinity is not None and affinity not in AFFINITIES:
        raise ValueError(f"@rollart_dask.env({name!r}): affinity {affinity!r} is not one of {', '.join(AFFINITIES)}")

    def wrap(factory):
        if not callable(factory):
            raise TypeError(f"@rollart_dask.env({name!r}) decorates a class or factory, got {factory!r}")
        _register(ENVS, name, factory)
        factory.__rollart__ = {"kind": "env", "name": name, "affinity": affinity}
        return factory

    return wrap


def reward(name: str, *, stateless: bool = True) -> Callable:
    """Register a reward function ``fn(trajectory) -> float | {"score": ...}`` as ``name``. ``stateless``:
    it may run anywhere, once per call (serverless mode: as a Lambda function); False: it keeps state
    between calls, so it stays on the REWARD pool in either mode."""
    if not isinstance(stateless, bool):
        raise TypeError(f"@rollart_dask.reward({name!r}): stateless is True or False, got {stateless!r}")

    def wrap(fn):
        if not callable(fn):
            raise TypeError(f"@rollart_dask.reward({name!r}) decorates a function, got {fn!r}")
        _register(REWARDS, name, fn)
        fn.__rollart__ = {"kind": "reward", "name": name, "stateless": stateless}
        return fn

    return wrap


def declared(registry: Registry, name: str) -> dict:
    """What a decorator declared on the object ``name`` names ({} when none), importing nothing: a name
    whose module is not imported here has declared nothing yet (the flow's ``imports`` import it)."""
    target: Any = registry.peek(name) if name in registry else name
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(sys.modules.get(module), attr, None) if attr else None
    return dict(getattr(target, "__rollart__", None) or {})


def handler(event, context):
    """The Lambda handler of a decorated reward: the function's environment names it (``ROLLART_REWARD``)."""
    module, _, attr = os.environ[TARGET_ENV].partition(":")
    return getattr(importlib.import_module(module), attr)(event)
