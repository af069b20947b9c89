"""Written contracts of the data plane's services (docs/architecture.md): what the runtime — task functions,
the weight store, the step loop — calls on an engine, a trainer and the reward runner.

Backends implement them without inheriting (``typing.Protocol``), and are built from their flow
section by ``from_config`` (``EngineBackend`` / ``TrainerBackend``; registered in data/backends.py).
``runtime_checkable`` only checks that names exist; ``conformance`` checks signatures too.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, EngineConfig, LoraConfig, TrainerConfig
    from rollart_dask.data.kv import PrefillHandle
    from rollart_dask.types import Completion


@runtime_checkable
class Engine(Protocol):
    """An inference engine in a worker of an engine pool."""

    version: int  # policy version it generates with (stamped on every completion)
    stats: dict  # counters the run reads (tokens, requests, busy_s, …)

    def generate(self, requests: list[dict]) -> list[Completion]:
        """Decode requests together; one completion per request, in order (aborted: finish_reason "abort")."""

    def abort(self, request_ids: list[str]) -> int:
        """Cooperative: the requests end at the engine's next step (Dask cannot stop a running task)."""

    def update_weights(self, version: int, weights: dict) -> int:
        """Swap in the weights the store staged (HF names) and take ``version``; the prefix cache goes too."""

    def reset_prefix_cache(self) -> int:
        """Recompute KV after an update (the protocol's last phase); returns entries dropped."""


@runtime_checkable
class DisaggregatingEngine(Engine, Protocol):
    """Optional capability for ``rollout.pd`` (which backends have it: capabilities.PD)."""

    def prefill(self, requests: list[dict]) -> list[PrefillHandle]:
        """Prefill and sample each first token; a handle carries what another engine needs to go on."""

    def decode_from_prefill(self, handles: list[PrefillHandle], stale: str = "reprefill") -> list[Completion]:
        """Decode from handles prefilled elsewhere; a handle of another policy version is re-prefilled here
        (``stale="reprefill"``) or refused (``"error"``)."""


@runtime_checkable
class StreamingEngine(Engine, Protocol):
    """Optional capability: an engine that batches continuously across calls, so streamed tasks start
    each request on ``pool`` and answer it when it alone is done (the emulated engine)."""

    pool: Executor


class EngineBackend(Protocol):
    """An engine class as the registry holds it: built in the worker from the flow's sections."""

    @classmethod
    def from_config(
        cls,
        cfg: EngineConfig,
        *,
        model_dir: str,
        seed: int = 0,
        pool: str | None = None,
        emulation: EmulationConfig | None = None,
        lora: LoraConfig | None = None,
    ) -> Engine:
        """``pool``: the engine pool of the worker it runs in; ``emulation``: the flow's emulation section; ``lora``: the
        trainer's adapter (trainer.lora), which ``update_weights`` then receives alone (passed only when set: the flow
        allows it with the real backends alone)."""


@runtime_checkable
class Trainer(Protocol):
    """The long-lived learner in the TRAIN worker."""

    version: int  # published optimizer updates (a warm start counts as one)

    def train_step(self, samples: list[dict]) -> dict:
        """One optimizer update on per-turn samples; version + 1; returns metrics (``version`` among them)."""

    def state_dict(self) -> dict:
        """The weights engines pull, in the names their models use (HF)."""

    def save_checkpoint(self, path: str | Path) -> str:
        """Write a checkpoint that ``restore`` (and, for real models, an engine) can load; returns its path."""

    def restore(self, path: str | Path) -> int:
        """Load a checkpoint; returns its version."""

    def warm_start(
        self, demos: list[dict], steps: int, batch_size: int, lr: float, seed: int = 0, shares: dict[str, float] | None = None
    ) -> dict:
        """Imitation of expert demonstrations before RL; counts as one published version."""


class TrainerBackend(Protocol):
    """A trainer class as the registry holds it."""

    @classmethod
    def from_config(
        cls, cfg: TrainerConfig, *, model_dir: str, seed: int = 0, temperature: float = 1.0, emulation: EmulationConfig | None = None
    ) -> Trainer:
        """``temperature``: the engines' sampling temperature, which the log-probs are recomputed at."""


@runtime_checkable
class RewardRunner(Protocol):
    """What reward tasks call on a reward worker's runner (data/reward_runner.py)."""

    stats: dict

    def is_stateful(self, name: str) -> bool:
        """Whether reward ``name`` needs an engine (a judge): scored by ``score_stateful``."""

    def score(self, item: dict) -> dict:
        """One plain reward: ``{"score": float, …}``; raises when it cannot be obtained."""

    def score_stateful(self, items: list[dict]) -> list[tuple]:
        """Stateful rewards as one batched generation; per item ("ok", result) or ("err", message)."""

    def map(self, fn: Callable, items: list) -> Iterable:
        """How a batch of plain rewards is scored (concurrent invocations when serverless)."""


# -- conformance: names, kinds and signatures ---------------------------------------------------------
def _members(proto: type) -> dict[str, Any]:
    """name → the protocol's own object (function, classmethod), or None for a declared attribute."""
    out: dict[str, Any] = {}
    for base in reversed(proto.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        out.update({k: None for k in base.__dict__.get("__annotations__", {})})
        out.update({k: v for k, v in vars(base).items() if not k.startswith("_") and (callable(v) or isinstance(v, classmethod))})
    return out


def _signature(where: str, want, have, bound: bool) -> list[str]:
    """Problems of ``have`` accepting every call ``want`` allows (names, kinds, defaults)."""
    P = inspect.Parameter
    w = list(inspect.signature(want).parameters.values())[0 if bound else 1 :]  # unbound methods: drop self
    h = list(inspect.signature(have).parameters.values())[0 if bound else 1 :]
    positional = [q for q in h if q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    by_name = {q.name: q for q in h if q.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    problems = []
    for i, p in enumerate(w):
        if p.kind is P.POSITIONAL_OR_KEYWORD:
            q = positional[i] if i < len(positional) else None
            if q is None or q.name != p.name or q.kind is not p.kind:
                problems.append(f"{where}: parameter {i + 1} must be {p.name!r} (positional or keyword), got {q.name if q else 'none'!r}")
                continue
        else:  # keyword-only in the contract
            q = by_name.get(p.name)
            if q is None:
                problems.append(f"{where}: has no keyword parameter {p.name!r}")
                continue
        if p.default is not P.empty and q.default is P.empty:
            problems.append(f"{where}: {p.name!r} needs a default (callers may leave it out)")
    for q in h:
        if q.name in {p.name for p in w}:
            continue
        if q.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):  # swallows mistakes the contract should catch
            problems.append(f"{where}: takes {'*' if q.kind is P.VAR_POSITIONAL else '**'}{q.name}; declare the parameters")
        elif q.default is P.empty:
            problems.append(f"{where}: extra parameter {q.name!r} needs a default (the contract's callers never pass it)")
    return problems


def conformance(impl: type, proto: type) -> list[str]:
    """What class ``impl`` lacks or declares otherwise than ``proto`` (empty: it conforms). An attribute
    counts when the class declares it (annotation, property or class attribute), set in ``__init__`` or not."""
    annotated = {k for c in impl.__mro__ for k in c.__dict__.get("__annotations__", {})}
    missing = object()
    problems = []
    for name, want in _members(proto).items():
        have = inspect.getattr_static(impl, name, missing)
        where = f"{impl.__qualname__}.{name}"
        if want is None:
            if have is missing and name not in annotated:
                problems.append(f"{where}: missing (declare it on the class: '{name}: …')")
            elif have is not missing and callable(have) and not isinstance(have, property):
                problems.append(f"{where}: a method, where {proto.__name__} has an attribute")
        elif have is missing:
            problems.append(f"{where}: missing")
        elif isinstance(want, classmethod) != isinstance(have, classmethod):
            problems.append(f"{where}: must {'' if isinstance(want, classmethod) else 'not '}be a classmethod")
        elif not callable(getattr(impl, name)):
            problems.append(f"{where}: not a method")
        else:
            problems += _signature(where, getattr(proto, name), getattr(impl, name), isinstance(want, classmethod))
    return problems
