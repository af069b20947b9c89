"""The private names this package relies on, looked up by name (``check``), so a missing one is reported at once."""

from __future__ import annotations

import importlib


class DistributedIncompatible(RuntimeError):
    """The installed distributed (or Bokeh) lacks a private name rollart-dask needs."""


# (where, attribute path, what it is for): each resolved by ``check``; one test per row removes it and expects the error
HOOKS: tuple[tuple[str, str, str], ...] = (
    ("distributed", "Client._reconnect", "told at once when the client loses the scheduler (control/recovery.py)"),
    ("distributed", "Client._ensure_connected", "dialling the scheduler again after a reconnect race"),
    ("distributed", "Client.scheduler_comm", "the identity of the client's scheduler connection"),
    ("distributed.batched", "BatchedSend", "the pinned-call channels' batched writes (control/dispatch.py, data/channels.py)"),
    ("distributed.comm", "connect", "opening a channel to a worker"),
    ("distributed.core", "Status.dont_reply", "a worker handler that keeps its comm (the channel) and answers nothing"),
    ("distributed", "Worker.handlers", "installing the channel handler on a worker"),
    ("distributed.diagnostics.task_stream", "TaskStreamPlugin.buffer", "filing channel batches into the task stream"),
    ("distributed.diagnostics.task_stream", "TaskStreamPlugin.index", "the task stream's record count its readers page by"),
    ("distributed.spans", "Span._cumulative_worker_metrics", "charging channel batches to their span's metrics"),
    ("distributed", "Scheduler.worker_plugins", "the worker plugins a run registered, unregistered when it leaves an attached cluster"),
    ("distributed", "Scheduler.nanny_plugins", "the nanny plugins a run registered, unregistered when it leaves an attached cluster"),
    ("distributed.deploy.subprocess", "SubprocessScheduler._start", "the embedded scheduler in its own process"),
    ("distributed", "Nanny._instances", "the chaos faults' Nanny of a worker"),
    ("distributed.core", "Status.closing_gracefully", "the chaos faults' Nanny told not to restart its worker"),
    ("distributed", "SpecCluster._correct_state", "the chaos faults' worker added to a running cluster"),
    ("distributed.dashboard.core", "BokehApplication", "the RollArt page added to a running dashboard"),
    ("distributed.dashboard.scheduler", "template_variables", "the dashboard's navigation bar on the RollArt page"),
    ("distributed.dashboard.scheduler", "applications", "the RollArt page listed in JupyterLab's Dask extension"),
    ("distributed.dashboard.components.scheduler", "BOKEH_THEME", "the dashboard's theme on the RollArt page"),
    ("distributed.dashboard.components.scheduler", "env", "the dashboard's page template on the RollArt page"),
)


def resolve(module: str, path: str):
    """The object at ``module``.``path``; DistributedIncompatible naming it where it is missing."""
    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = _attribute(obj, part)
    except (ImportError, AttributeError) as e:
        import distributed

        raise DistributedIncompatible(
            f"distributed {distributed.__version__} has no {module}.{path} ({e}); rollart-dask was tested with the versions setup.cfg pins"
        ) from None
    return obj


def _attribute(obj, name: str):
    """Also an instance attribute a class sets up in __init__ or declares by annotation (e.g. Client.scheduler_comm)."""
    if hasattr(obj, name):
        return getattr(obj, name)
    if isinstance(obj, type):
        assigned = _init_assigned(obj)
        if name in getattr(obj, "__annotations__", {}) or assigned is None or name in assigned:  # (None: no source to read)
            return name
    raise AttributeError(f"{obj.__name__ if isinstance(obj, type) else obj!r} has no attribute {name!r}")


def _init_assigned(cls: type) -> set[str] | None:
    """The attributes the __init__ methods of ``cls`` and its bases assign; None where none of their source can be read
    (an install without .py files: those hooks then go unchecked rather than reported missing)."""
    import inspect
    import re

    names: set[str] = set()
    read = False
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if inspect.isfunction(init):
            try:
                names |= set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(init)))
                read = True
            except (OSError, TypeError):
                pass
    return names if read else None


def check(dashboard: bool = True) -> None:
    """Every hook of HOOKS resolves; DistributedIncompatible listing those that do not. ``dashboard=False`` leaves out
    the dashboard's, which import Bokeh (a run's client does not need it; the scheduler adding the page checks them)."""
    missing = []
    for module, path, why in HOOKS:
        if not dashboard and module.startswith("distributed.dashboard"):
            continue
        try:
            resolve(module, path)
        except DistributedIncompatible as e:
            missing.append(f"{module}.{path} ({why}): {e}")
    if missing:
        import distributed

        raise DistributedIncompatible(f"distributed {distributed.__version__} lacks what rollart-dask uses:\n  " + "\n  ".join(missing))
