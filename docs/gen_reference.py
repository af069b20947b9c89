"""The flow and CLI reference pages, generated from the code: the flow schema's field descriptions
(rollart_dask/config/schema.py) and the click commands (rollart_dask/entry/cli.py).

    python docs/gen_reference.py          # writes docs/reference/flow.md and docs/reference/cli.md

mkdocs runs it before each build (a hook in mkdocs.yml), and a test fails when a committed page differs
from what this writes, or when a schema key or a command is missing from it.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from pathlib import Path

import click
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

DOCS = Path(__file__).resolve().parent
PAGES = {"flow": DOCS / "reference" / "flow.md", "cli": DOCS / "reference" / "cli.md"}


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type_text(annotation) -> str:
    while typing.get_origin(annotation) is typing.Annotated:  # tagged unions: the types, not their tags
        annotation = typing.get_args(annotation)[0]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " \\| ".join(_type_text(a) for a in args)
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(repr(m.value) for m in annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    text = text or re.sub(r"\b[a-z_]+(\.[a-z_]+)*\.(?=[A-Z])", "", str(annotation).replace("typing.", ""))
    return text.replace("|", "\\|")


def _default_text(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that wants the validated data
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(its section's defaults)"
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            return f"({len(value)} entries)"
    elif field.default is PydanticUndefined:
        return "**required**"
    else:
        value = field.default
    return f"`{value!r}`".replace("|", "\\|")


def flow_keys(model: type[BaseModel] = None, prefix: str = "") -> list[tuple[str, object, type[BaseModel]]]:
    """Every key of the flow schema, dotted (``tasks[].prompt.stop``), with its field and the model it belongs to."""
    from rollart_dask.config import FlowConfig

    model = model or FlowConfig
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append((key, field, model))
        for sub in _models_in(field.annotation):
            many = typing.get_origin(field.annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(field.annotation)
            )
            keyed = typing.get_origin(field.annotation) is dict or any(
                typing.get_origin(a) is dict for a in typing.get_args(field.annotation)
            )
            out += flow_keys(sub, f"{key}[]." if many else f"{key}.NAME." if keyed else f"{key}.")
    return out


def flow_reference() -> str:
    lines = [
        "# Flow reference",
        "",
        "Every key of a flow file, generated from the schema's own descriptions (`rollart_dask/config/schema.py`). "
        "A key not listed here is refused at load with the allowed keys named. `--set KEY=VALUE` takes the same "
        "dotted keys (`tasks.NAME.KEY` for a task). `tasks[]` is a list of tasks; `NAME` is a key of your choosing.",
        "",
    ]
    sections: dict[str, list[str]] = {}  # a section's rows together, in the order sections first appear
    for key, field, model in flow_keys():
        head = key.rsplit(".", 1)[0] if "." in key else ""
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        sections.setdefault(head, []).append(f"| `{key}` | {_type_text(field.annotation)} | {_default_text(field)} | {desc} |")
    for head, rows in sections.items():
        lines += ["", f"## `{head}`" if head else "## Top level", "", "| key | type | default | description |", "|---|---|---|---|", *rows]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def cli_commands(group: click.Group = None, prefix: str = "rollart") -> list[tuple[str, click.Command]]:
    from rollart_dask.entry.cli import main

    group = group or main
    out = []
    for name in sorted(group.commands):
        cmd = group.commands[name]
        if cmd.hidden:
            continue
        out.append((f"{prefix} {name}", cmd))
        if isinstance(cmd, click.Group):
            out += cli_commands(cmd, f"{prefix} {name}")
    return out


def cli_reference() -> str:
    lines = [
        "# CLI reference",
        "",
        "Every `rollart` command and its options, generated from the click commands "
        "(`rollart_dask/entry/`). `rollart COMMAND --help` prints the same.",
        "",
    ]
    for path, cmd in cli_commands():
        ctx = click.Context(cmd, info_name=path)
        usage = cmd.get_usage(ctx).removeprefix("Usage: ")
        lines += [f"## `{path}`", "", inspect.cleandoc(cmd.help or cmd.short_help or ""), "", f"```\n{usage}\n```", ""]
        params = [p for p in cmd.params if not getattr(p, "hidden", False)]
        if params:
            lines += ["| argument / option | description |", "|---|---|"]
            for p in params:
                names = ", ".join(p.opts) if isinstance(p, click.Option) else p.human_readable_name
                help_ = (getattr(p, "help", None) or "").replace("|", "\\|").replace("\n", " ")
                if isinstance(p, click.Option) and p.show_default and p.default not in (None, False, ()):
                    help_ += f" (default: `{p.default}`)"
                lines.append(f"| `{names}` | {help_} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write() -> list[Path]:
    """Write both pages where they differ; return those written."""
    written = []
    for name, text in (("flow", flow_reference()), ("cli", cli_reference())):
        path = PAGES[name]
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def on_pre_build(config, **kwargs):  # the mkdocs hook
    write()


if __name__ == "__main__":
    for p in write():
        print(f"wrote {p}")
