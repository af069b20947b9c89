"""A user's own code in a flow: the modules of the flow key ``imports`` and Python flow files.

``imports`` lists Python files (``my_agent.py``, relative to the flow file) and module names
(an installed package). The client imports each one when the flow is loaded, so what their
decorators declare (rollart_dask/declare.py) is known while the flow validates; the run then has
every worker import them too (a file is shipped to the workers: data/plugins.py ``user_code``), a
worker that joins later included. A file is imported under its stem as module name, on the client
as on the workers, so its classes and functions pickle by reference.

A Python flow file (``rollart run my_flow.py``) defines ``flow``: a FlowConfig, a dict, or a function
returning either. It is imported like an ``imports`` file (workers import it as well, so it may hold
the decorated envs and rewards itself; it must not start anything at import time).
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from typing import Any


class UserCodeError(ValueError):
    """A module of ``imports`` or a Python flow that cannot be imported; the message names it."""


class UserFunctionError(RuntimeError):
    """A user's env or reward raised, or gave what it may not, while a run called it: a fault of their code, not of the
    infrastructure (the run counts it per task and stops past rollout.user_faults). The first line names the function and
    the exception; the lines after it are the innermost frames of its traceback."""


def user_error(where: str, e: BaseException, frames: int = 3) -> UserFunctionError:
    """``e``, raised by the user's ``where`` (e.g. ``FrozenLakeEnv.step``), as a UserFunctionError with its last frames."""
    if isinstance(e, UserFunctionError):
        return e
    own = str(Path(__file__).parent)  # the runtime's frames say nothing about the user's code
    stack = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(own)][-frames:]
    trace = "".join(traceback.format_list(stack)).rstrip()
    line = (str(e).strip().splitlines() or [""])[0]
    return UserFunctionError(f"{where} raised {type(e).__name__}: {line}" + (f"\n{trace}" if trace else ""))


def resolve(item: str, base: Path | None) -> str:
    """A file entry as an absolute path (relative to ``base``, the flow file's folder); a module name as it is."""
    if not isinstance(item, str) or not item.strip():
        raise UserCodeError(f"imports: {item!r} is neither a Python file (.py) nor a module name")
    if not item.endswith(".py"):
        return item
    path = Path(item).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise UserCodeError(f"imports: {item!r}: no such file ({path})")
    return str(path)


def module_name(item: str) -> str:
    return Path(item).stem if item.endswith(".py") else item


def import_item(item: str):
    """Import one resolved ``imports`` entry here; its module."""
    name = module_name(item)
    if item.endswith(".py"):
        if not name.isidentifier():
            raise UserCodeError(f"imports: {item}: {name!r} is not a valid module name (rename the file)")
        loaded = sys.modules.get(name)
        if loaded is not None:
            where = getattr(loaded, "__file__", None)
            if where is None or Path(where).resolve() != Path(item):
                raise UserCodeError(f"imports: {item}: a module {name!r} is already imported from {where or 'a built-in'}; rename the file")
            return loaded
        folder = str(Path(item).parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    except UserCodeError:
        raise
    except Exception as e:
        raise UserCodeError(f"imports: {item}: import failed: {type(e).__name__}: {e}") from e


def import_all(items: list[str], base: Path | None = None) -> list[str]:
    """Resolve and import every entry; the resolved entries (what the flow records)."""
    resolved = [resolve(i, base) for i in items]
    for item in resolved:
        import_item(item)
    return resolved


def python_flow(path: Path) -> dict:
    """The flow a Python flow file builds, as a dict (the keys it set), with the file first in ``imports``."""
    item = resolve(str(path), None)
    module = import_item(item)
    built: Any = getattr(module, "flow", None)
    if built is None:
        raise UserCodeError(f"{path}: a Python flow defines `flow` (a FlowConfig, a dict, or a function returning one)")
    if callable(built) and not isinstance(built, dict) and not hasattr(built, "model_dump"):
        built = built()
    if hasattr(built, "model_dump"):  # a FlowConfig (not imported here: rollart_dask.config imports this module)
        built = built.model_dump(exclude_unset=True)  # only what the file set: defaults (and declared affinities) stay defaults
    if not isinstance(built, dict):
        raise UserCodeError(f"{path}: `flow` gave {type(built).__name__}; expected a FlowConfig or a dict")
    imports = [resolve(i, path.parent) for i in built.get("imports") or []]
    return {**built, "imports": [item, *(i for i in imports if i != item)]}
