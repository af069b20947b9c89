"""The declarative API without a cluster: decorators, the flow key ``imports``, Python flow files, and
the Lambda zip of a decorated reward (run by the local endpoint in tests/test_declared_cluster.py)."""

import io
import subprocess
import sys
import textwrap
import zipfile

import pytest

import rollart_dask
from rollart_dask.config import FlowError, load_flow
from rollart_dask.declare import TARGET_ENV, declared, handler
from rollart_dask.registry import ENVS, REWARDS, get_reward, make_env
from tests.conftest import flow_dict

MODULE = """
import rollart_dask


@rollart_dask.env("{name}-env", affinity="decode")
class Walk:
    action_choices = ("L", "R")

    def reset(self, seed):
        return "P.G", {{}}

    def step(self, action):
        return "PG", 1.0, True, False, {{"success": True}}

    def close(self):
        pass


@rollart_dask.reward("{name}-reward")
def score(trajectory):
    return 2.0


@rollart_dask.reward("{name}-kept", stateless=False)
def kept(trajectory):
    return 1.0
"""


def user_module(folder, name):
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(MODULE.format(name=name))
    return path


def task(name, **kw):
    return {"name": "t", "env": f"{name}-env", "reward": f"{name}-reward", **kw}


def test_imports_of_a_yaml_flow_register_the_decorated_names_and_their_affinity(tmp_path):
    user_module(tmp_path / "code", "decl_yaml_mod")
    flow = tmp_path / "flow.yaml"
    import yaml

    flow.write_text(yaml.safe_dump(flow_dict(imports=["code/decl_yaml_mod.py"], tasks=[task("decl_yaml_mod")])))
    cfg = load_flow(flow)  # relative to the flow file, wherever the command runs
    assert cfg.imports == [str((tmp_path / "code" / "decl_yaml_mod.py").resolve())]
    assert cfg.tasks[0].affinity == "decode" and cfg.tasks[0]._affinity_from == "declared by @rollart_dask.env"
    assert make_env("decl_yaml_mod-env").reset(0) == ("P.G", {})
    assert get_reward("decl_yaml_mod-reward")({}) == 2.0
    assert declared(REWARDS, "decl_yaml_mod-kept") == {"kind": "reward", "name": "decl_yaml_mod-kept", "stateless": False}
    again = load_flow(flow, ["tasks.t.affinity=prefill"])  # a flow key wins over the declaration, and says so
    assert again.tasks[0].affinity == "prefill" and again.tasks[0]._affinity_from == "flow (its env declares decode)"


def test_a_python_flow_file_builds_the_config_and_is_imported_first(tmp_path):
    user_module(tmp_path, "decl_py_mod")
    (tmp_path / "decl_py_flow.py").write_text(
        textwrap.dedent(f"""
        from rollart_dask.config import FlowConfig

        def flow():
            return FlowConfig.model_validate({flow_dict(imports=["decl_py_mod.py"], tasks=[task("decl_py_mod")])!r})
    """)
    )
    cfg = load_flow(tmp_path / "decl_py_flow.py", ["trainer.steps=7"])
    assert cfg.trainer.steps == 7 and cfg.tasks[0].affinity == "decode"
    assert [p.rsplit("/", 1)[-1] for p in cfg.imports] == ["decl_py_flow.py", "decl_py_mod.py"]  # workers import both


@pytest.mark.parametrize(
    "text, error",
    [
        ("x = 1\n", "defines `flow`"),
        ("flow = 3\n", "`flow` gave int; expected a FlowConfig or a dict"),
        ("import no_such_module_here\nflow = {}\n", "import failed: ModuleNotFoundError"),
    ],
)
def test_a_bad_python_flow_file_is_an_error_naming_it(tmp_path, text, error):
    path = tmp_path / f"bad_flow_{abs(hash(text))}.py"
    path.write_text(text)
    with pytest.raises(FlowError, match=error):
        load_flow(path)


def test_bad_imports_are_errors_naming_the_entry(tmp_path):
    with pytest.raises(FlowError, match=r"imports: 'missing.py': no such file"):
        load_flow(data=flow_dict(imports=["missing.py"]))
    with pytest.raises(FlowError, match=r"imports: no_such_pkg_xyz: import failed: ModuleNotFoundError"):
        load_flow(data=flow_dict(imports=["no_such_pkg_xyz"]))
    (tmp_path / "json.py").write_text("")  # a stem that is another module's name would import that one on the workers
    with pytest.raises(FlowError, match=r"a module 'json' is already imported from .*rename the file"):
        load_flow(data=flow_dict(imports=[str(tmp_path / "json.py")]))


def test_decorators_refuse_bad_declarations_and_a_taken_name():
    with pytest.raises(ValueError, match=r"affinity 'gpu' is not one of prefill, decode, any, auto"):
        rollart_dask.env("x", affinity="gpu")
    with pytest.raises(ValueError, match="without ':'"):
        rollart_dask.reward("a:b")(lambda t: 0.0)
    with pytest.raises(TypeError, match="stateless is True or False"):
        rollart_dask.reward("x", stateless="yes")
    with pytest.raises(ValueError, match="env 'frozenlake' is already registered"):
        rollart_dask.env("frozenlake")(type("Other", (), {"__module__": "somewhere"}))
    main = type("Script", (), {"__module__": "__main__"})
    with pytest.raises(ValueError, match="declare it in an importable module"):
        rollart_dask.env("from-a-script")(main)


def test_the_same_module_imported_again_registers_itself_again(tmp_path):
    user_module(tmp_path, "decl_twice_mod")
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        first = importlib.import_module("decl_twice_mod")
        importlib.reload(first)  # e.g. a worker loading an uploaded file again
        assert ENVS.get("decl_twice_mod-env") is first.Walk
    finally:
        sys.path.remove(str(tmp_path))


def test_import_rollart_dask_is_light():
    code = "import sys, rollart_dask; print(sorted(m for m in ('dask', 'distributed', 'torch', 'pydantic') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_a_decorated_rewards_zip_holds_its_module_and_the_declarative_api(tmp_path, monkeypatch):
    from rollart_dask.data.serverless import build_zip

    user_module(tmp_path, "decl_zip_mod")
    load_flow(data=flow_dict(imports=[str(tmp_path / "decl_zip_mod.py")], tasks=[task("decl_zip_mod")]))
    names = set(zipfile.ZipFile(io.BytesIO(build_zip("decl_zip_mod-reward"))).namelist())
    assert {
        "decl_zip_mod.py",
        "rollart_dask/__init__.py",
        "rollart_dask/declare.py",
        "rollart_dask/registry.py",
    } <= names
    assert not any(n.startswith(("rollart_dask/control", "rollart_dask/data")) for n in names)
    monkeypatch.setenv(TARGET_ENV, "decl_zip_mod:score")  # what deploy sets for the generic handler
    assert handler({"info": {}}, None) == 2.0
