"""Flow loading: a YAML or Python flow file (or a dict), ``--set key=value`` overrides, the user's ``imports``, then
the schema (schema.py). Every error is a FlowError that names the key, and for an unknown key the allowed ones."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rollart_dask.config.schema import FlowConfig


class FlowError(ValueError):
    """A flow file or override that does not validate; the message names the key."""


UNION_TAGS = ("pd-auto", "pd-route")  # a tagged union's branch in an error's location (rollout.pd), not a key


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"] if p not in UNION_TAGS) or "(flow)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            allowed = _allowed_keys(e["loc"][:-1])
            if allowed:
                msg += f" (allowed: {', '.join(allowed)})"
        elif e["type"] == "literal_error":
            msg = f"bad value {e.get('input')!r}: {e['msg'].lower()}"
        lines.append(f"  {key}: {msg}")
    return "invalid flow:\n" + "\n".join(lines)


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = FlowConfig
    for part in loc:
        if isinstance(part, int) or part in UNION_TAGS:
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next(_models_in(field.annotation), None)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def _models_in(ann):
    """The pydantic models a (possibly Optional, Annotated or union) annotation holds."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        yield ann
    for a in getattr(ann, "__args__", ()):  # (Annotated[X, …] holds X there too)
        yield from _models_in(a)


def _parse_value(text: str, key: str = "") -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise FlowError(f"--set {key}={text}: the value is not valid YAML ({_yaml_problem(e)}); quote it to set a string") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """The parser's complaint and where, in one line (a flow file: its line and column, counted from 1)."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + (getattr(e, "problem", None) or str(e).splitlines()[0])


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides (values parsed as YAML; list items addressed by index or task name)."""
    for item in overrides:
        if "=" not in item:
            raise FlowError(f"--set {item!r}: expected key=value, e.g. rollout.alpha=2")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            node = _child(node, part, key, create=True)
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, key)] = _parse_value(value, key)
        else:
            node[last] = _parse_value(value, key)
    return data


def _index(node: list, part: str, key: str) -> int:
    if part.isdigit() and int(part) < len(node):
        return int(part)
    for i, item in enumerate(node):
        if isinstance(item, dict) and item.get("name") == part:
            return i
    raise FlowError(f"--set {key}: no list item {part!r} (use an index or a task/worker name)")


def _child(node: Any, part: str, key: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, key)]
    if not isinstance(node, dict):
        raise FlowError(f"--set {key}: {part!r} is not a section")
    if part not in node or node[part] is None:
        node[part] = {}
    return node[part]


def load_flow(path: str | Path | None = None, overrides: list[str] | None = None, data: dict | None = None) -> FlowConfig:
    """Load a flow from YAML, a Python flow file (rollart_dask/usercode.py) or a dict, apply overrides, import
    the flow's ``imports`` (here; the run has the workers import them too), validate."""
    from rollart_dask import usercode

    base = None
    if data is None:
        p = Path(path)  # type: ignore[arg-type]
        base = p.parent
        if not p.exists():
            raise FlowError(f"flow file not found: {p}")
        if p.suffix == ".py":
            try:
                data = usercode.python_flow(p)
            except usercode.UserCodeError as e:
                raise FlowError(str(e)) from None
        else:
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise FlowError(f"{p}: not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(data, dict):
            raise FlowError(f"{p}: a flow is a YAML mapping at top level")
    data = apply_overrides(copy.deepcopy(data), list(overrides or []))  # the caller's dict is left as it was
    if isinstance(data.get("imports"), list):  # (anything else is left to validation, which names the key)
        try:
            data["imports"] = usercode.import_all(data["imports"], base)
        except usercode.UserCodeError as e:
            raise FlowError(str(e)) from None
    try:
        return FlowConfig.model_validate(data)
    except ValidationError as err:
        raise FlowError(_format_errors(err)) from None
