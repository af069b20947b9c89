"""The optional dependencies (setup.cfg's extras): a missing one is named with the extra that brings it."""

from __future__ import annotations

import importlib
import importlib.util


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str, needed_for: str) -> None:
    """Raise MissingExtra unless ``module`` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{needed_for} needs the package {module!r}, which is not installed: pip install 'rollart-dask[{extra}]'")
