"""`ruff check` is clean (pyproject.toml's [tool.ruff]: unused and undefined names, pycodestyle's error classes), and the
code is as `ruff format` writes it at the project's line length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


FOLDERS = ["rollart_dask", "envs", "rewards", "benchmarks", "flows", "tests", "docs", "deploy", "setup.py"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "ruff"
    assert exe.exists(), f"ruff is not installed beside {sys.executable}: pip install -e '.[dev]'"
    return subprocess.run([str(exe), *args, *FOLDERS], cwd=ROOT, capture_output=True, text=True)


def test_ruff_check_is_clean():
    r = ruff("check", "--output-format", "concise")
    assert r.returncode == 0, f"ruff check found problems (ruff check --fix mends some):\n{r.stdout}{r.stderr}"


def test_ruff_format_is_clean():
    r = ruff("format", "--check")
    assert r.returncode == 0, f"files ruff format would change (run ruff format {' '.join(FOLDERS)}):\n{r.stdout}{r.stderr}"
