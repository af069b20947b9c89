"""The chaos suite's scenarios at tiny scale, each a real quickstart run on the embedded default with its faults
fired: the run completes, nothing is lost (every launched trajectory in one outcome, every batch full, none
trained twice or without its reward) and nothing leaks (every env made is closed, no sandbox process left)."""

import json
import subprocess
import sys

import pytest

from rollart_dask.config import load_flow
from rollart_dask.tools.chaos.runner import run_scenario, shared_cluster
from rollart_dask.tools.chaos.scenarios import SCENARIOS

# rollout.max_trained_lag=1: no trained token more than a version behind the trainer, through every fault
BUDGET = (
    "trainer.steps=6",
    "rollout.batch_groups=4",
    "eval.every=0",
    "eval.seeds=6",
    "observe.progress=false",
    "rollout.max_trained_lag=1",
)
# the longest (tens of seconds to a minute each), and enough of the others that the default stage stays under 15 minutes;
# what stays covers each plane (an env worker and the trainer's lost, an engine, the trainer and a reward worker restarted,
# the reward endpoint restarted, elasticity, the scheduler's connection cut, the checkpoints' disk full); those that share
# the module's cluster take seconds each
SLOW = {
    "env-worker-restart",
    "engine-worker-restart-mid-update",
    "elastic-env",
    "env-worker-lost-mid-train",
    "trainer-worker-restart",
    "env-faults",
    "reward-endpoint-faults",
    "process-kill-resume",
    "code-env-worker-restart",
    "mooncake-master-restart",
    "reward-worker-lost",
}
# what each scenario must have made the runtime do (beyond completing with nothing lost)
EXPECT = {
    "env-worker-restart": {"workers_lost": 1, "relaunched": 1},
    "env-worker-lost": {"workers_lost": 1},
    "env-worker-lost-mid-train": {"workers_lost": 1},
    "reward-worker-restart": {"workers_lost": 1},
    "reward-worker-lost": {"workers_lost": 1, "reward_errors": 1},
    "engine-worker-restart": {"engines_lost": 1, "engines_joined": 1},
    "engine-worker-restart-mid-update": {"engines_lost": 1, "engines_joined": 1},
    "elastic-engine": {"engines_joined": 1, "engines_lost": 1},
    "elastic-env": {"workers_lost": 1},
    "env-faults": {"failed": 1, "relaunched": 1},
    "checkpoint-disk-full": {"checkpoint_failed": 2},
    "scheduler-connection-drop": {"scheduler_reconnects": 3, "train_resubmitted": 1},
    "code-env-worker-restart": {"workers_lost": 1, "relaunched": 1},
    **{
        name: {"trainer_recovered": 1, "trainer_replay_identical": 1, "steps_redone": 1}
        for name in ("trainer-worker-restart", "trainer-worker-restart-mid-update", "trainer-worker-lost")
    },
}


def scenario_params():
    for name in SCENARIOS:
        if name != "baseline":
            marks = [pytest.mark.slow] if name in SLOW else []
            if "weights.store=mooncake" in SCENARIOS[name].overrides:
                marks.append(pytest.mark.needs("libibverbs"))  # (tests/conftest.py)
            yield pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module")
def scheduler():
    """One cluster of the quickstart's workers for the scenarios that leave it as found (the others start their own)."""
    with shared_cluster(load_flow("flows/quickstart.yaml")) as address:
        yield address


@pytest.mark.parametrize("name", scenario_params())
def test_a_chaos_scenario_loses_and_leaks_nothing(name, tmp_path, scheduler):
    row = run_scenario(
        load_flow("flows/quickstart.yaml"), SCENARIOS[name], tmp_path, seed=1, budget=BUDGET, limit_s=240, scheduler=scheduler
    )
    assert row["completed"], (row.get("error"), row.get("waiting_in"))
    assert row["shared_cluster"] == SCENARIOS[name].can_share_cluster, row  # a worker lost or added: a cluster of its own
    assert not row["inject_errors"] and len(row["faults"]) == len(SCENARIOS[name].faults), row
    assert row["samples_lost"] == 0 and row["accounting"]["unaccounted"] == 0, row["accounting"]
    assert row["leaked_processes"] == 0, row
    if name == "process-kill-resume":  # (its envs died with the killed process: there is no count of them to read)
        # the version and the optimizer's steps go on from the checkpoint; with one every step, at most the step in flight
        # at the kill is redone
        assert row["continued"] and 0 <= row["steps_redone"] <= 1, row
    else:
        assert row["leaked_envs"] == 0, row
        assert row["steps"] == max(6, SCENARIOS[name].min_steps), row  # one optimizer step per step: none trained twice, none lost
        assert row["envs"]["envs_made"] == row["envs"]["envs_closed"] > 0, row["envs"]
        assert not row["checkpoints"]["partial"] and row["checkpoints"]["latest_whole"], row["checkpoints"]  # failed writes leave none
        assert row["token_lag_max"] <= 1 and row["counts"]["samples_over_lag_dropped"] == 0, row  # the bound held, by Get Batch
        for key, least in EXPECT.get(name, {}).items():
            assert row["counts"].get(key, 0) >= least, (key, row["counts"])


@pytest.mark.slow
def test_rollart_chaos_prints_the_table_and_writes_the_results(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollart_dask.entry.cli",
            "chaos",
            "flows/quickstart.yaml",
            "--scenario",
            "env-worker-restart",
            "--steps",
            "4",
            "--out",
            str(tmp_path),
            "--set",
            "rollout.batch_groups=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "COLUMNS": "250"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "env-worker-restart"] and all(r["completed"] for r in rows)
    table = (tmp_path / "table.md").read_text()
    assert "| env-worker-restart | kill cpu-0" in table and "samples lost" in table


def test_a_final_checkpoint_that_cannot_be_written_ends_the_run_saying_where_and_what_is_left(tmp_path, scheduler):
    from rollart_dask.tools.chaos.scenarios import TRAINER, Fault, Scenario

    full = Scenario(
        "disk-full-to-the-end",
        "the disk full for the checkpoints from the start",
        (Fault("fill_disk", TRAINER, "rollout", 0, 0.0),),
        overrides=("trainer.checkpoint_every=2",),
    )
    budget = ("trainer.steps=2", *BUDGET[1:])
    row = run_scenario(load_flow("flows/quickstart.yaml"), full, tmp_path, seed=1, budget=budget, scheduler=scheduler)
    assert not row["completed"] and not row["inject_errors"] and row["shared_cluster"], row
    assert "final checkpoint could not be written" in row["error"] and "after 3 tries" in row["error"], row["error"]
    assert "No space left on device" in row["error"] and "there is none yet" in row["error"], row["error"]
    assert not list((tmp_path / "checkpoints").glob("step-*")), "a failed write left a checkpoint behind"


def test_the_table_compares_seconds_per_planned_step_and_marks_a_failed_run():
    from rollart_dask.tools.chaos.suite import cells

    base = {"scenario": "baseline", "completed": True, "elapsed_s": 5.0, "steps_planned": 10, "samples_lost": 0}
    longer = {
        "scenario": "elastic-env",
        "completed": True,
        "elapsed_s": 18.0,
        "steps_planned": 24,
        "samples_lost": 0,
        "faults": ["add worker"],
    }
    failed = {"scenario": "x", "completed": False, "error": "TimeoutError: it hangs", "elapsed_s": 240.0, "steps_planned": 6}
    assert cells(base, base)[5] == "1.00×" and cells(longer, base)[5] == "1.50×"  # 0.75 s/step against 0.5 s/step
    assert cells(failed, base)[2] == "no: TimeoutError: it hangs" and cells(failed, base)[3] == cells(failed, base)[5] == "–"


def test_scenarios_are_chosen_by_name_or_a_comma_list_after_the_baseline():
    from rollart_dask.tools.chaos.scenarios import select

    assert [s.name for s in select("trainer-worker-lost, elastic-env")] == ["baseline", "trainer-worker-lost", "elastic-env"]
    with pytest.raises(ValueError, match="unknown chaos scenario no-such"):
        select("trainer-worker-lost,no-such")
