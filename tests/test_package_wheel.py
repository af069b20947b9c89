"""The package as a user gets it: the wheel, built without warnings, installed alone in a fresh venv, runs the
quickstart for a few steps, and does not install a top-level `envs` or `rewards` (those names are the user's)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lines of the verbose build log that are not the package's: pip's notice about this machine's configured index
# folders, and distutils' note that PYTHONDONTWRITEBYTECODE turned byte-compiling off.
NOT_OURS = (re.compile(r"WARNING: Location '.*' is ignored"), re.compile(r"warning: \w+: byte-compiling is disabled"))


def warnings_in(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if re.search(r"warning", line, re.I) and not any(p.search(line) for p in NOT_OURS)]


def test_the_log_filter_keeps_what_setuptools_warns():
    planted = (
        "  SetuptoolsDeprecationWarning: License classifiers are deprecated.\n"
        "  warning: build_py: byte-compiling is disabled, skipping.\n"
        "  _Warning: Package 'envs.latency' is absent from the `packages` configuration.\n"
    )
    assert warnings_in(planted) == [
        "SetuptoolsDeprecationWarning: License classifiers are deprecated.",
        "_Warning: Package 'envs.latency' is absent from the `packages` configuration.",
    ]


@pytest.mark.slow
def test_the_wheel_alone_runs_the_quickstart(tmp_path):
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert warnings_in(build.stdout + build.stderr) == []
    shutil.rmtree(REPO / "build", ignore_errors=True)  # what setuptools leaves in the tree
    (wheel,) = dist.glob("rollart_dask-*.whl")

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    pip = [py, "-m", "pip", "install", "-q"]
    # torch first and pinned, as the README's install does (anything else may pull a CUDA build)
    assert subprocess.run([*pip, "torch==2.13.0"], env=env, timeout=900).returncode == 0
    install = subprocess.run([*pip, str(wheel)], env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    assert warnings_in(install.stderr) == []

    work.mkdir()  # the repository is off the path: the run sees the installed package only
    shutil.copy(REPO / "flows" / "quickstart.yaml", work / "flow.yaml")
    probe = subprocess.run(
        [
            py,
            "-c",
            "import rollart_dask.envs, rollart_dask.rewards, sys; print(rollart_dask.envs.__file__)\n"
            "try:\n import envs\nexcept ModuleNotFoundError:\n sys.exit(0)\nsys.exit(3)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(venv) in probe.stdout  # the installed copy, not the checkout
    run = subprocess.run(
        [
            str(venv / "bin" / "rollart"),
            "run",
            "flow.yaml",
            "--out",
            "out",
            "--set",
            "trainer.steps=3",
            "--set",
            "eval.seeds=10",
            "--set",
            "observe.progress=false",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((work / "out" / "summary.json").read_text())
    assert summary["steps"] == 3, summary
