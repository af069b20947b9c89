"""The user-fault guards that need no cluster: what a reward may return, the circuit breaker's thresholds, what counts as
the user's fault, the trainer refusing a NaN/inf update, and non-finite weights never packed for publishing or saved."""

import math
from pathlib import Path

import pytest
import torch

from rollart_dask.control.breaker import FaultBreaker, UserCodeFailed, as_user_fault, is_user_fault
from rollart_dask.control.dispatch import CallFailed, WorkerLost
from rollart_dask.data.reward_value import RewardValueError, reward_value
from rollart_dask.data.weights.buckets import NonFiniteWeights, publish_buckets
from rollart_dask.usercode import UserFunctionError, user_error


@pytest.mark.parametrize(
    "out, named",
    [
        (float("nan"), "score nan"),
        ({"score": float("inf")}, "score inf"),
        (float("-inf"), "score -inf"),
        ("1.0", "score '1.0' (str)"),
        (None, "score None (NoneType)"),
        ({"success": True}, "a dict without 'score' (keys ['success'])"),
        (True, "score True (bool)"),
        ({"score": [1.0]}, "score [1.0] (list)"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_an_error_naming_the_value(out, named):
    with pytest.raises(RewardValueError) as e:
        reward_value("mine", out)
    assert f"reward 'mine' returned {named}" in str(e.value) and "a finite number, or a dict with a finite numeric 'score'" in str(e.value)
    assert isinstance(e.value, UserFunctionError)  # the user's fault: counted per task by the breaker


def test_finite_rewards_pass_as_floats_with_their_other_fields():
    assert reward_value("r", 1) == {"score": 1.0}
    assert reward_value("r", {"score": 0, "success": False}) == {"score": 0.0, "success": False}


def fault(task="t", call="reward"):
    return UserCodeFailed(task, call, "reward 'r' raised KeyError: 'x'\n  File \"mod.py\", line 3")


def test_the_breaker_trips_after_k_failures_in_a_row_of_one_task_and_an_ok_resets_the_run():
    b = FaultBreaker(consecutive=3, share=0.9, window=100)
    assert b.failed(fault()) is None and b.failed(fault()) is None
    b.ok("t")  # a finished trajectory of the task breaks the row
    assert b.failed(fault()) is None and b.failed(fault()) is None
    assert b.failed(fault("other")) is None  # per task
    stop = b.failed(fault())
    assert stop is not None
    text = str(stop)
    assert "task 't': 3 groups in a row failed (3 trajectories) in its reward: reward 'r' raised KeyError: 'x'" in text
    assert 'File "mod.py", line 3' in text and "failed trajectories so far by call: reward 5" in text


def test_the_breaker_trips_on_a_share_of_the_last_window_and_never_with_consecutive_zero():
    b = FaultBreaker(consecutive=100, share=0.5, window=10)
    for i in range(20):  # every other one fails: not more than half
        assert (b.failed(fault(call="step")) if i % 2 else b.ok("t")) is None
    stop = b.failed(fault(call="step"))  # 6 of the last 10
    assert stop is not None and "6 of the 10 trajectories of its last 10 groups failed" in str(stop)
    assert b.failed(fault(call="step")) is None  # once: the run is stopping
    off = FaultBreaker(consecutive=0, share=0.5, window=10)
    assert all(off.failed(fault()) is None for _ in range(50)) and off.failures["t", "reward"] == 50


def test_the_breaker_counts_groups_so_a_reward_failing_on_one_problem_in_ten_never_stops_the_run():
    """Every trajectory of a problem (a group) fails together when the reward fails on that problem: a group of 8 is
    one failure in a row, not 8."""
    b = FaultBreaker(consecutive=4, share=0.5, window=20)
    for g in range(200):  # 10% of the problems fail in the reward, each with its whole group of 8
        for _ in range(8):
            assert (b.failed(fault(), f"g{g}") if g % 10 == 3 else b.ok("t", f"g{g}")) is None
    assert b.failures["t", "reward"] == 20 * 8 and not b.tripped
    for g in range(200, 204):  # a reward that now fails on every problem: 4 groups in a row
        stops = [b.failed(fault(), f"g{g}") for _ in range(8)]
    assert stops[0] is not None and "4 groups in a row failed (25 trajectories)" in str(stops[0])


def test_failures_scattered_over_most_groups_stop_the_run_only_past_the_share_of_trajectories():
    """10% of trajectories failing at random (a flaky env) touch 57% of groups of 8: the run goes on. Half and more of
    the trajectories failing, spread the same way, stops it."""
    import random

    rng = random.Random(0)
    b = FaultBreaker(consecutive=4, share=0.5, window=20)
    for g in range(300):
        for _ in range(8):
            assert (b.failed(fault(call="step"), f"g{g}") if rng.random() < 0.1 else b.ok("t", f"g{g}")) is None
    touched = sum(1 for f, _ in b.recent["t"].values() if f)
    assert not b.tripped and touched > 5  # most recent groups held a failure, and it did not stop the run
    stops = [b.failed(fault(call="step"), f"h{g}") if rng.random() < 0.6 else b.ok("t", f"h{g}") for g in range(40) for _ in range(8)]
    assert any(s is not None and "trajectories of its last 20 groups failed" in str(s) for s in stops)


def test_only_the_users_code_is_a_user_fault_never_the_infrastructure():
    assert is_user_fault("reward", CallFailed("reward: RewardFunctionError: handler raised"))
    assert is_user_fault("env-step", CallFailed("env-step: UserFunctionError: MyEnv.step raised ValueError: x"))
    assert is_user_fault("env-step", TimeoutError("env-step on cpu-0 gave no answer in 30s"))  # a hung env
    assert not is_user_fault("reward", TimeoutError("reward on reward-0 gave no answer in 30s"))
    assert not is_user_fault("reward", CallFailed("reward: RewardUnavailable: endpoint down"))
    assert not is_user_fault("env-step", CallFailed("env-step: KeyError: no env for trajectory t on this worker"))
    assert not is_user_fault("env-step", WorkerLost("gone"))
    e = CallFailed("env-reset: UserFunctionError: MyEnv.reset raised KeyError: 'x'")
    f = as_user_fault("env-reset", "maze", e)
    assert isinstance(f, UserCodeFailed) and (f.task, f.call) == ("maze", "reset") and f.detail.startswith("MyEnv.reset raised KeyError")


def test_user_error_keeps_the_innermost_frames_of_the_users_traceback():
    def users_reward(t):
        return t["missing"]

    try:
        users_reward({})
    except KeyError as e:
        err = user_error("reward 'mine' (mod.users_reward)", e)
    first, *frames = str(err).splitlines()
    assert first == "reward 'mine' (mod.users_reward) raised KeyError: 'missing'"
    assert any("users_reward" in line for line in frames) and any('return t["missing"]' in line for line in frames)


def test_non_finite_weights_are_never_packed_for_publishing():
    ok = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)}
    publish_buckets(ok, 1, 1 << 20)
    with pytest.raises(NonFiniteWeights, match=r"weights v2: 1 of 3 weight tensors hold NaN or inf \(c\)"):
        publish_buckets({**ok, "c": torch.tensor([1.0, math.nan])}, 2, 1 << 20)


def test_the_trainer_skips_and_counts_a_nan_update_and_stops_after_three_in_a_row(model_dir, tmp_path):
    from rollart_dask.data.trainer_torch import NONFINITE_LIMIT, NonFiniteUpdate, TorchTrainer

    trainer = TorchTrainer(str(model_dir), lr=1e-2)
    prompt = trainer.tokenizer.encode("ab")
    sample = {"prompt_ids": prompt, "response_ids": prompt[:1], "logprobs": [-1.0], "allowed_ids": None, "advantage": 1.0}
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    for n in range(1, NONFINITE_LIMIT):
        stats = trainer.train_step([dict(sample, advantage=math.nan), sample])
        assert stats["nonfinite_skipped"] == 1 and stats["version"] == n
        assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())  # nothing applied
    trainer.save_checkpoint(tmp_path / "ok")  # still finite: saved
    assert trainer.train_step([sample])["nonfinite_skipped"] == 0 and trainer.nonfinite_in_a_row == 0  # a sound one resets the row
    assert any(not torch.equal(before[k], v) for k, v in trainer.state_dict().items())
    for _ in range(NONFINITE_LIMIT - 1):
        trainer.train_step([dict(sample, advantage=math.inf)])
    with pytest.raises(NonFiniteUpdate, match=r"NaN/inf at 3 updates in a row, the last the update after version 5"):
        trainer.train_step([dict(sample, advantage=math.inf)])
    with torch.no_grad():
        next(p for p in trainer.model.parameters() if p.requires_grad).fill_(math.nan)
    with pytest.raises(NonFiniteWeights, match="checkpoint of version"):
        trainer.save_checkpoint(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "override, named",
    [
        ("eval.start_seed=0", "eval.start_seed: Input should be greater than or equal to 1000"),
        ("tasks.frozenlake.weight=.inf", "tasks.0.weight: Input should be a finite number"),
        ("trainer.lr=.nan", "trainer.lr: Input should be a finite number"),
        ("rollout.env_timeout_s=.inf", "rollout.env_timeout_s: Input should be a finite number"),
        ("rollout.group_size=1", "group_size 1 (tasks ['frozenlake']): the grpo advantage is each reward minus its group's mean"),
        ("rollout.group_size=[1", "--set rollout.group_size=[1: the value is not valid YAML (line 1, column 3: expected ',' or ']'"),
    ],
)
def test_flow_values_that_would_break_a_run_are_refused_at_load_naming_the_key(override, named):
    from rollart_dask.config import FlowError, load_flow

    with pytest.raises(FlowError) as e:
        load_flow(Path(__file__).parent.parent / "flows" / "quickstart.yaml", [override])
    assert named in " ".join(str(e.value).split())


def test_a_malformed_flow_file_is_a_flow_error_naming_its_line(tmp_path):
    from rollart_dask.config import FlowError, load_flow

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntasks:\n  - name: a\n   env: b\n")
    with pytest.raises(FlowError, match=r"bad.yaml: not valid YAML: line 4, column 4: expected <block end>"):
        load_flow(bad)


class _Planted:
    def __reduce__(self):  # what a tampered trainer_state.pt would run on load, were it unpickled
        return (exec, ("open('PLANTED', 'w').write('ran')",))


def test_trainer_state_is_loaded_without_unpickling_code(model_dir, tmp_path, monkeypatch):
    import pickle

    from rollart_dask.data.trainer_torch import TorchTrainer

    monkeypatch.chdir(tmp_path)
    trainer = TorchTrainer(str(model_dir), lr=1e-2)
    prompt = trainer.tokenizer.encode("ab")
    trainer.train_step([{"prompt_ids": prompt, "response_ids": prompt[:1], "logprobs": [-1.0], "allowed_ids": None, "advantage": 1.0}])
    path = Path(trainer.save_checkpoint(tmp_path / "ckpt"))
    assert TorchTrainer(str(model_dir), lr=1e-2).restore(path) == 1  # optimizer state and version load as plain data
    torch.save({"optimizer": trainer.opt.state_dict(), "version": 1, "x": _Planted()}, path / "trainer_state.pt", pickle_module=pickle)
    with pytest.raises(pickle.UnpicklingError):
        TorchTrainer(str(model_dir), lr=1e-2).restore(path)
    assert not (tmp_path / "PLANTED").exists()


def test_a_cut_last_metrics_line_is_left_out_by_readers_and_cut_before_a_resumed_run_appends(tmp_path):
    from rollart_dask.observe import MetricsWriter, read_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "step", "step": 1}\n{"kind": "st')
    assert read_rows(path) == [{"kind": "step", "step": 1}]
    w = MetricsWriter(tmp_path)  # (a resumed run)
    w.write({"kind": "step", "step": 2})
    w.close()
    assert [r["step"] for r in read_rows(path)] == [1, 2]
    path.write_text('{"kind": "st\n{"kind": "step", "step": 1}\n')
    with pytest.raises(ValueError, match="line 1: not JSON"):  # a cut line that is not the last is damage, said
        read_rows(path)


def test_resume_refuses_an_empty_latest_pointer(tmp_path, run_async):
    from rollart_dask.control.wiring import restore

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("")
    with pytest.raises(FileNotFoundError, match=r"latest names '', which is not a checkpoint directory"):
        run_async(restore(None, tmp_path))
