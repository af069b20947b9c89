"""The architecture as a test (standard library only): the import graph of rollart_dask has no cycle
and no edge from a lower layer to a higher one, envs/ and rewards/ import nothing of the runtime,
and a long module says at its top why it is long.

Every import counts, at module level or inside a function: a lazy import is still a dependency.
A backend named by a "module:attr" string in a registry (data/backends.py) is not an import: that is
how the data plane finds the emulated backends of the emulation tool without depending on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "rollart_dask"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "vocabulary",
        (
            "rollart_dask.compat",
            "rollart_dask.types",
            "rollart_dask.resource.pools",
            "rollart_dask.capabilities",
        ),
    ),
    (
        "config and pure parts",
        (
            "rollart_dask.config",
            "rollart_dask.observe",
            "rollart_dask.trackers",
            "rollart_dask.registry",
            "rollart_dask.declare",
            "rollart_dask.usercode",
            "rollart_dask.extras",
            "rollart_dask.algo",
            "rollart_dask.models",
        ),
    ),
    ("resource plane", ("rollart_dask.resource",)),
    ("data plane", ("rollart_dask.data",)),
    ("control plane", ("rollart_dask.control",)),
    ("beside the runtime", ("rollart_dask.emulation", "rollart_dask.serve", "rollart_dask.tools.report", "rollart_dask.tools.replay")),
    ("entry", ("rollart_dask.entry.api", "rollart_dask.entry.launch")),
    ("experiments", ("rollart_dask.tools.ablation",)),
    ("command line", ("rollart_dask.entry.cli", "rollart_dask")),
]
OUTSIDE = (f"{PKG}.envs", f"{PKG}.rewards")
LONG = 400  # lines; a longer module states why at its top ("Why this module is long: …")


def modules(top: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` (at ``path``) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.startswith(OUTSIDE):  # envs/ and rewards/: installed inside the package, outside the runtime's graph
                continue
            while t and t not in known:  # `import a.b.c` of a name inside a module: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{name} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return rank


def graph() -> dict[str, set[str]]:
    mods = modules(PKG)
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_no_layer_imports_a_layer_above_it():
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph().items()
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]
    assert upward == []


@pytest.mark.parametrize("top", ["envs", "rewards"])
def test_envs_and_rewards_never_import_the_runtime(top):
    for name, path in modules(top).items():
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        assert not [m for m in names if m == PKG or m.startswith(PKG + ".")], f"{name} imports the runtime"
        # installed as rollart_dask.envs / rollart_dask.rewards: a relative import may reach the other one, no further
        depth = name.count(".") + (path.name == "__init__.py")
        beyond = [
            n.module
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level > depth and not (n.module or "").startswith(("envs", "rewards"))
        ]
        assert not beyond, f"{name} imports {beyond} from the runtime"


def test_a_long_module_says_why_at_its_top():
    long = []
    for name, path in modules(PKG).items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > LONG and "Why this module is long:" not in doc:
            long.append(f"{name} ({lines} lines)")
    assert long == []


def test_the_checks_can_fail():
    """The checker itself: a cycle and an upward edge planted in a graph are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("rollart_dask.data.tasks") < layer_of("rollart_dask.control.run") < layer_of("rollart_dask.serve.dashboard.page")
    assert layer_of("rollart_dask.tools.ablation.measure") > layer_of("rollart_dask.entry.api")


def private_run_reads(source: str, filename: str = "<source>") -> list[str]:
    """``run._x`` / ``self.run._x`` (a Run's private attribute) in ``source``: the lines that read one."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name in ("run", "run_"):
                found.append((node.lineno, f"{filename}:{node.lineno} .{node.attr}"))
    return [f for _, f in sorted(found)]


def test_no_module_reads_a_private_attribute_of_run_outside_run_py():
    """Recovery, telemetry, stopping and the rest talk to the run through its public state (failing, stopped, counts…)."""
    found = []
    for top in (PKG, "benchmarks"):
        for name, path in modules(top).items():
            if name != f"{PKG}.control.run":
                found += private_run_reads(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []
    assert private_run_reads("await self.run._fatal.wait()\nrun._stopped = 1\nrun.stopped\n") == [
        "<source>:1 ._fatal",
        "<source>:2 ._stopped",
    ]


def names_the_run(source: str) -> list[int]:
    """The lines of ``source`` that name a ``run`` (a variable, parameter or attribute): a helper handed the whole run."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        self_run = isinstance(node, ast.Attribute) and node.attr == "run" and isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Name) and node.id == "run" or self_run:  # (client.run, a Dask call, is not the run)
            found.add(node.lineno)
        elif isinstance(node, ast.arg) and node.arg == "run":
            found.add(node.lineno)
    return sorted(found)


def test_recovery_elasticity_membership_and_telemetry_are_not_handed_the_run():
    """They are given the run's status record (version, counters, how it fails) and its services, never the run."""
    for helper in ("recovery", "elastic", "membership", "status", "telemetry"):
        path = ROOT / PKG / "control" / f"{helper}.py"
        assert names_the_run(path.read_text()) == [], f"{path.relative_to(ROOT)} names the run"
    assert names_the_run("def f(run):\n    x = 1\n    self.run.counts\n    client.run(fn)\n") == [1, 3]
