"""`rollart init DIR`: a new project that runs as it is, and a refusal to write into a used directory."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from rollart_dask.entry.cli import main


def test_init_writes_a_project_and_refuses_a_used_directory(tmp_path):
    target = tmp_path / "proj"
    res = CliRunner().invoke(main, ["init", str(target)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "flow.yaml", "my_env.py", "my_reward.py"]
    from rollart_dask.config import load_flow

    flow = load_flow(str(target / "flow.yaml"))  # its imports register the declared env and reward
    assert flow.name == "proj" and flow.tasks[0].env == "proj_walk" and flow.tasks[0].affinity == "decode"
    again = CliRunner().invoke(main, ["init", str(target)])
    assert again.exit_code == 1 and f"{target} is not empty" in again.output


@pytest.mark.slow
def test_the_scaffold_runs_as_it_is(tmp_path):
    target = tmp_path / "mine"
    cli = [sys.executable, "-m", "rollart_dask.entry.cli"]
    assert subprocess.run([*cli, "init", str(target)], capture_output=True, text=True, timeout=60).returncode == 0
    out = tmp_path / "run"
    res = subprocess.run(
        [
            *cli,
            "run",
            str(target / "flow.yaml"),
            "--out",
            str(out),
            "--set",
            "trainer.steps=3",
            "--set",
            "eval.seeds=10",
            "--set",
            "observe.progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3, summary
