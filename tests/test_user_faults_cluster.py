"""A user's own reward and env code failing on a real run (the shared local cluster, the tiny model, FrozenLake): what
fails at once is refused by the pre-flight, every problem listed, before anything generates; what fails only on the
run's trajectories ends in an error that names their function within seconds of the breaker's threshold, or, below
it, in failures counted and never trained — never a hang, never a NaN trained or published. The code:
tests/user_code/faults_mod.py."""

import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollart_dask.config import load_flow
from rollart_dask.control.breaker import UserFault
from tests.conftest import close, flow_dict, start_run

MOD = str(Path(__file__).parent / "user_code" / "faults_mod.py")
TASK = {"name": "frozenlake", "env": "frozenlake", "reward": "frozenlake", "affinity": "prefill", "max_turns": 6, "max_tokens": 2}


BAD_TASKS = [
    dict(TASK, name="bad-reward", reward="faults_mod:always_raises"),
    dict(TASK, name="bad-step", env="faults_mod:StepRaises"),
    dict(TASK, name="no-such-env", env="nosuchenv"),
    dict(TASK, name="dict-obs", env="faults_mod:DictObservation"),
    dict(TASK, name="inf-reward", reward="faults_mod:returns_inf"),
    dict(TASK, name="string-reward", reward="faults_mod:returns_string"),
    dict(TASK, name="bad-args", env_args={"sizee": 3}),
]
PREFLIGHT_SAYS = [
    "task 'bad-reward': reward: reward 'faults_mod:always_raises' (faults_mod.always_raises) raised KeyError: 'no such key'",
    "task 'bad-step': env: StepRaises.step raised RuntimeError: the user's step is broken",
    "task 'no-such-env': env: env 'nosuchenv' with env_args {} raised UnknownName: unknown env 'nosuchenv'; registered:",
    "task 'dict-obs': env: DictObservation.reset returned an observation of type dict",
    "reward 'faults_mod:returns_inf' returned score inf",
    "reward 'faults_mod:returns_string' returned score '1.0' (str)",
    "task 'bad-args': env: env 'frozenlake' with env_args {'sizee': 3} raised TypeError",
]


def test_the_preflight_lists_every_tasks_failing_env_and_reward_before_anything_generates(address, tmp_path, model_dir, run_async):
    from rollart_dask.control.preflight import PreflightError

    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address, "imports": [MOD], "tasks": [TASK, *BAD_TASKS]}))
    with pytest.raises(PreflightError) as e:
        run_async(start_run(cfg, tmp_path, model_dir), timeout=120)
    text = str(e.value)
    assert text.startswith("pre-flight: 7 of 8 tasks fail before any generation") and "task 'frozenlake'" not in text
    for said in PREFLIGHT_SAYS:
        assert said in text, said
    assert 'return trajectory["no such key"]' in text  # the user's traceback


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
def test_rollart_check_runs_the_preflight_alone(address, tmp_path):
    import yaml
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main

    flow = tmp_path / "flow.yaml"
    flow.write_text(yaml.safe_dump(flow_dict(**{"imports": [MOD], "tasks": [TASK, *BAD_TASKS[:2]]})))
    res = CliRunner().invoke(main, ["check", str(flow), "--scheduler", address])
    assert res.exit_code == 1 and "pre-flight: 2 of 3 tasks fail before any generation" in res.output, res.output
    flow.write_text(yaml.safe_dump(flow_dict(**{"imports": [MOD], "tasks": [TASK]})))
    res = CliRunner().invoke(main, ["check", str(flow), "--scheduler", address])
    assert res.exit_code == 0 and "pre-flight passed: 1 task(s)" in res.output and "task frozenlake: env played" in res.output, res.output


def run_with(address, tmp_path, model_dir, run_async, task: dict, **over):
    """(result or the exception the run ended with, its rows, seconds from the run's start to its end)."""
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "imports": [MOD],
                "tasks": [dict(TASK, **task)],
                "rollout.user_faults": {"consecutive": 4},
                "trainer.checkpoint_every": 1,
                **over,
            }
        )
    )

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        t0 = time.monotonic()
        try:
            try:
                out = await run.run()
            except Exception as e:
                out = e
            return out, run.metrics.rows, time.monotonic() - t0
        finally:
            await close(run, client, cluster)

    return run_async(go(), timeout=240)


def stopped(out, *names: str) -> str:
    assert isinstance(out, UserFault), out
    text = str(out)
    for name in names:
        assert name in text, text
    return text


def test_a_reward_that_raises_on_the_runs_trajectories_stops_the_run_naming_the_function_and_its_traceback(
    address, tmp_path, model_dir, run_async
):
    out, rows, seconds = run_with(address, tmp_path, model_dir, run_async, {"reward": "faults_mod:raises_later"})
    text = stopped(
        out,
        "task 'frozenlake': 4 groups in a row failed",
        "faults_mod.raises_later) raised KeyError: 'no such key'",
        'else trajectory["no such key"]',
    )
    assert seconds < 60, seconds
    assert out.partial["stopped_by"] == "UserFault" and out.partial["counts"]["user_faults_reward"] >= 4 and out.partial["steps"] == 0
    assert out.partial["checkpoint"], "a user fault leaves the trainer sound: its weights are saved"
    assert not [r for r in rows if r["kind"] == "step"]  # nothing trained on a reward that never came
    assert text.splitlines()[0].startswith("stopped: ")


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
def test_nan_rewards_on_some_trajectories_are_failures_counted_never_trained(address, tmp_path, model_dir, run_async):
    out, rows, _ = run_with(
        address,
        tmp_path,
        model_dir,
        run_async,
        {"reward": "faults_mod:nan_on_even_turns"},
        **{"rollout.user_faults": {"consecutive": 0}, "trainer.steps": 3},
    )
    assert isinstance(out, dict), out
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 3 and out["counts"]["user_faults_reward"] > 0 and out["counts"]["failed"] > 0
    for r in steps:
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "loss", "grad_norm")) and r["nonfinite_skipped"] == 0
    weights = load_file(str(Path(out["checkpoint"]) / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
@pytest.mark.parametrize("reward, value", [("string_later", "score '1.0' (str)"), ("inf_later", "score inf")])
def test_a_reward_value_that_is_not_a_finite_number_stops_the_run_naming_it(address, tmp_path, model_dir, run_async, reward, value):
    out, rows, _ = run_with(address, tmp_path, model_dir, run_async, {"reward": f"faults_mod:{reward}"})
    stopped(out, "in its reward: ", value, "a finite number, or a dict with a finite numeric 'score'")


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
@pytest.mark.parametrize(
    "env, names",
    [
        ("StepRaisesLater", ("in its step: ", "StepRaisesLater.step raised RuntimeError: the user's step is broken", "faults_mod.py")),
        ("DictObservationLater", ("in its step: ", "DictObservationLater.step returned an observation of type dict", "is a string")),
    ],
)
def test_an_env_that_raises_or_returns_no_text_on_the_runs_trajectories_stops_the_run_naming_it(
    address, tmp_path, model_dir, run_async, env, names
):
    out, _, seconds = run_with(address, tmp_path, model_dir, run_async, {"env": f"faults_mod:{env}"})
    stopped(out, *names)
    assert seconds < 60, seconds


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
def test_an_env_step_that_hangs_past_its_timeout_stops_the_run(address, tmp_path, model_dir, run_async):
    out, _, seconds = run_with(
        address,
        tmp_path,
        model_dir,
        run_async,
        {"env": "faults_mod:StepHangsLater"},
        **{"rollout.env_timeout_s": 2, "rollout.user_faults": {"consecutive": 2}, "eval.seeds": 1},
    )
    stopped(out, "in its step: ", "env-step on", "gave no answer in 2s")
    assert seconds < 60, seconds


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
def test_max_minutes_ends_a_run_on_time_even_when_no_step_completes(address, tmp_path, model_dir, run_async):
    out, rows, seconds = run_with(
        address,
        tmp_path,
        model_dir,
        run_async,
        {"reward": "faults_mod:raises_later"},
        **{"rollout.user_faults": {"consecutive": 0}, "trainer.max_minutes": 0.25, "trainer.steps": 50},
    )
    assert isinstance(out, dict) and out["steps"] == 0 and out["counts"]["user_faults_reward"] > 0, out
    assert seconds < 15 + 30, seconds  # the deadline, then the final evaluation (whose calls fail fast) and checkpoint


@pytest.mark.slow  # (each a tiny run on the shared cluster; the default stage keeps the pre-flight and the breaker on a reward)
def test_rollart_run_ends_a_user_fault_with_its_error_not_a_traceback_and_writes_the_summary(address, tmp_path):
    import json

    import yaml
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main

    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            flow_dict(
                **{"imports": [MOD], "tasks": [dict(TASK, reward="faults_mod:raises_later")], "rollout.user_faults": {"consecutive": 4}}
            )
        )
    )
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", str(flow), "--scheduler", address, "--out", str(out)])
    assert res.exit_code == 1 and not isinstance(res.exception, KeyError), res.output
    text = " ".join(res.output.split())
    assert "Error: the run stopped after 0 steps: stopped: task 'frozenlake': 4 groups in a row failed" in text
    assert "Traceback (most recent call last)" not in res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "UserFault" and "raises_later" in summary["error"] and summary["checkpoint"]
    assert (out / "metrics.jsonl").exists()


def test_the_watchdog_reports_a_run_that_makes_no_progress_with_what_is_in_flight_and_where(address, tmp_path, model_dir, run_async):
    out, _, _ = run_with(
        address,
        tmp_path,
        model_dir,
        run_async,
        {"env": "faults_mod:StepHangsLater"},
        **{"rollout.env_timeout_s": 4, "rollout.user_faults": {"consecutive": 2}, "eval.seeds": 1, "observe.watchdog_s": 1},
    )
    stopped(out, "gave no answer in 4s")  # the hang ends the run; before that, the watchdog said where it stood
    report = (tmp_path / "watchdog.txt").read_text()
    assert "watchdog: no progress for" in report and "in flight by stage {" in report and "'env-step'" in report, report
    assert "envs by worker {" in report and "policy v0" in report and "--- " in report  # and every coroutine's stack
