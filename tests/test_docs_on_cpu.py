"""The docs: the generated references are up to date and cover every flow key and command, the site builds
strictly (no broken link), and the README stays short."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def schema_paths(schema: dict, node: dict, prefix: str = "") -> set[str]:
    """Every key path of the flow's JSON schema, walked on its own (not by the generator's code)."""
    out = set()
    for name, prop in node.get("properties", {}).items():
        key = prefix + name
        out.add(key)
        branches = [prop, *prop.get("anyOf", [])]
        branches += [b["items"] for b in branches if isinstance(b.get("items"), dict)]
        maps = [b["additionalProperties"] for b in branches if isinstance(b.get("additionalProperties"), dict)]
        for branch in branches + maps:
            if "$ref" in branch:
                sub = schema["$defs"][branch["$ref"].rsplit("/", 1)[1]]
                if "properties" not in sub:
                    continue
                many = any(b.get("items") is branch for b in branches)
                keyed = any(m is branch for m in maps)
                out |= schema_paths(schema, sub, f"{key}[]." if many else f"{key}.NAME." if keyed else f"{key}.")
    return out


def test_the_generated_pages_are_committed_as_generated():
    for name, text in (("flow", gen.flow_reference()), ("cli", gen.cli_reference())):
        assert gen.PAGES[name].read_text() == text, f"{gen.PAGES[name]} is stale: run `python docs/gen_reference.py`"


def test_the_flow_reference_covers_every_key():
    from rollart_dask.config import FlowConfig

    schema = FlowConfig.model_json_schema()
    page = gen.PAGES["flow"].read_text()
    missing = sorted(k for k in schema_paths(schema, schema) if f"| `{k}` |" not in page)
    assert not missing, f"flow keys missing from docs/reference/flow.md: {missing}"
    assert "| `tasks[].prompt.system_prompt` |" in page and "| `emulation.pools.NAME.gpus` |" in page


def test_the_cli_reference_covers_every_command_and_option():
    from rollart_dask.entry.cli import main

    page = gen.PAGES["cli"].read_text()
    info = main.to_info_dict(click.Context(main, info_name="rollart"))

    def walk(node: dict, path: str):
        for name, cmd in node.get("commands", {}).items():
            if cmd.get("hidden"):
                continue
            here = f"{path} {name}"
            assert f"## `{here}`" in page, f"command {here!r} missing from docs/reference/cli.md"
            for p in cmd["params"]:
                if p["param_type_name"] == "option" and not p.get("hidden") and p["opts"] != ["--help"]:
                    assert f"`{', '.join(p['opts'])}`" in page, f"option {p['opts']} of {here!r} missing from docs/reference/cli.md"
            walk(cmd, here)

    walk(info, "rollart")


def test_the_site_builds_strictly(tmp_path):
    if not shutil.which("mkdocs", path=str(Path(sys.executable).parent)):
        pytest.fail("mkdocs is missing: install the [docs] extra (`make test` does)")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "flow" / "index.html").exists()


def test_the_readme_fits_on_a_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200: the rest belongs in docs/)"
