"""distributed's private API lives in rollart_dask/compat alone, and a release without one of its hooks fails loudly."""

from __future__ import annotations

import ast
import asyncio
import importlib
import types
from pathlib import Path

import pytest

from rollart_dask import compat
from rollart_dask.compat.hooks import HOOKS, DistributedIncompatible, check, resolve

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_SUBMODULES = {"distributed.security", "distributed.diagnostics.plugin"}  # documented in distributed's API reference
PRIVATE_ATTRIBUTES = {
    "_reconnect",
    "_ensure_connected",
    "_timeout",
    "scheduler_comm",
    "handlers",
    "_cumulative_worker_metrics",
    "_instances",
    "_correct_state",
    "dont_reply",
    "closing_gracefully",
    "http_application",
}


def test_every_hook_resolves_on_the_installed_release():
    check()
    for module, path, _ in HOOKS:
        assert resolve(module, path) is not None


def _remove(monkeypatch, module: str, path: str) -> None:
    """Take the hook away as a release that dropped it would: a module attribute deleted; an attribute of a class (or
    an enum) gone from a stand-in that holds everything else the class defines (a new-style class object, so members
    its __init__ would set are not found either)."""
    mod = importlib.import_module(module)
    parts = path.split(".")
    if len(parts) == 1:
        monkeypatch.delattr(mod, parts[0])
        return
    owner, name = getattr(mod, parts[0]), parts[1]
    assert hasattr(owner, name) or name in (compat.hooks._init_assigned(owner) or ()), f"{path} is not there to remove"
    standin = types.SimpleNamespace(**{k: getattr(owner, k) for k in dir(owner) if k != name and not k.startswith("__")})
    monkeypatch.setattr(mod, parts[0], standin)


@pytest.mark.parametrize("module,path", [(m, p) for m, p, _ in HOOKS], ids=[p for _, p, _ in HOOKS])
def test_a_missing_hook_fails_loudly_naming_it(monkeypatch, module, path):
    _remove(monkeypatch, module, path)
    with pytest.raises(DistributedIncompatible, match=f"{module}.{path}".replace(".", r"\.")):
        check()
    if module.startswith("distributed.dashboard"):  # a run's client leaves the dashboard's hooks to the scheduler
        check(dashboard=False)


def _python_files():
    for folder in ("rollart_dask", "envs", "rewards", "benchmarks", "flows"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if "compat" not in f.relative_to(ROOT).parts:
                yield f


def test_private_names_of_distributed_appear_only_in_compat():
    found = []
    for f in _python_files():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            where = f"{f.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("distributed", "bokeh"):
                if node.module.startswith("bokeh.server") or (
                    node.module.startswith("distributed.") and node.module not in PUBLIC_SUBMODULES
                ):
                    found.append(f"{where} from {node.module} import …")
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{where} .{node.attr}")
    assert not found, "distributed's private API outside rollart_dask/compat:\n" + "\n".join(found)


def test_the_guard_sees_a_private_use(tmp_path, monkeypatch):
    """The scan above is not blind: a planted private use is found."""
    planted = ROOT / "rollart_dask" / "_planted_private_use.py"
    planted.write_text("from distributed.batched import BatchedSend\n\ndef f(client):\n    return client.scheduler_comm\n")
    try:
        with pytest.raises(
            AssertionError, match=r"_planted_private_use.py:1 from distributed.batched(.|\n)*_planted_private_use.py:4 \.scheduler_comm"
        ):
            test_private_names_of_distributed_appear_only_in_compat()
    finally:
        planted.unlink()


def test_reconnect_hook_is_told_first_and_the_client_reconnects():
    """On a real scheduler: the wrapped reconnect is told before it dials, the connection is a new one after, and
    undoing the wrap restores distributed's own method."""
    from distributed import Client, LocalCluster

    async def main():
        async with LocalCluster(n_workers=0, processes=False, asynchronous=True, dashboard_address=None) as cluster:
            async with Client(cluster, asynchronous=True) as client:
                told = []
                before = compat.scheduler_connection(client)
                undo = compat.wrap_reconnect(client, lambda: told.append(client.status), lambda: compat.dial_scheduler(client))
                await compat.cut_scheduler_connection(client)
                for _ in range(200):
                    if told and client.status == "running" and compat.scheduler_connection(client) is not before:
                        break
                    await asyncio.sleep(0.05)
                assert told, "the wrapped reconnect was not called"
                assert client.status == "running" and compat.scheduler_connection(client) is not before
                assert await client.scheduler.identity()
                undo()
                assert "_reconnect" not in vars(client)

    asyncio.run(main())


def test_every_hook_is_in_the_docs_table():
    table = (ROOT / "docs" / "reference" / "compat.md").read_text()
    missing = [f"{m}.{p}" for m, p, _ in HOOKS if f"`{m}.{p}`" not in table]
    assert not missing, f"docs/reference/compat.md lacks {missing}"
