"""`ruff check` is clean (pyproject.toml's [tool.ruff]: unused and undefined names, pycodestyle's error classes)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = Path(sys.executable).parent / "ruff"
    assert ruff.exists(), f"ruff is not installed beside {sys.executable}: pip install -e '.[dev]'"
    r = subprocess.run([str(ruff), "check", "--output-format", "concise", "rollart_dask", "envs", "rewards", "benchmarks", "flows",
                        "tests", "docs"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff check found problems (ruff check --fix mends some):\n{r.stdout}{r.stderr}"
