import pytest

from rollart_dask.config import FlowError, load_flow
from tests.conftest import flow_dict


def test_quickstart_flow_validates():
    cfg = load_flow("flows/quickstart.yaml")
    assert cfg.rollout.mode == "rollart" and cfg.rollout.level == "trajectory" and cfg.rollout.alpha == 1


def test_unknown_key_is_named_with_allowed_keys():
    data = flow_dict()
    data["rollout"]["alpah"] = 2
    with pytest.raises(FlowError) as e:
        load_flow(data=data)
    msg = str(e.value)
    assert "rollout.alpah: unknown key" in msg and "alpha" in msg and "group_size" in msg


def test_bad_literal_names_key_and_allowed_values():
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**{"rollout.mode": "async"}))
    msg = str(e.value)
    assert "rollout.mode" in msg and "'sync'" in msg and "'rollart'" in msg


def test_bad_number_names_key():
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**{"rollout.group_size": 0}))
    assert "rollout.group_size" in str(e.value)


@pytest.mark.parametrize(
    "mode,alpha,level,needle",
    [
        ("sync", 1, None, "rollout.mode=sync requires rollout.alpha=0"),
        ("sync", 0, "trajectory", "rollout.mode=sync requires"),
        ("one_off", 2, None, "rollout.mode=one_off requires rollout.alpha=1"),
    ],
)
def test_mode_rules(mode, alpha, level, needle):
    over = {"rollout.mode": mode, "rollout.alpha": alpha}
    if level:
        over["rollout.level"] = level
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**over))
    assert needle in str(e.value)


def test_max_trained_lag_is_at_most_alpha_and_defaults_to_it():
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**{"rollout.alpha": 1, "rollout.max_trained_lag": 2}))
    assert "rollout.max_trained_lag=2 is looser than rollout.alpha=1" in str(e.value) and "0..1" in str(e.value)
    assert load_flow(data=flow_dict(**{"rollout.alpha": 2})).rollout.lag_bound == 2
    assert load_flow(data=flow_dict(**{"rollout.alpha": 2, "rollout.max_trained_lag": 0})).rollout.lag_bound == 0


def test_mode_defaults():
    assert load_flow(data=flow_dict(**{"rollout.mode": "sync", "rollout.alpha": None})).rollout.alpha == 0
    cfg = load_flow(data=flow_dict(**{"rollout.mode": "one_off", "rollout.alpha": None}))
    assert (cfg.rollout.alpha, cfg.rollout.level) == (1, "batch")


def test_overrides_by_path_and_task_name():
    cfg = load_flow("flows/quickstart.yaml", ["rollout.alpha=2", "tasks.frozenlake.max_turns=5", "trainer.lr=1e-4"])
    assert cfg.rollout.alpha == 2 and cfg.tasks[0].max_turns == 5 and cfg.trainer.lr == 1e-4


def test_override_errors():
    with pytest.raises(FlowError, match="expected key=value"):
        load_flow("flows/quickstart.yaml", ["rollout.alpha"])
    with pytest.raises(FlowError, match="no list item 'nope'"):
        load_flow("flows/quickstart.yaml", ["tasks.nope.max_turns=3"])
    with pytest.raises(FlowError, match="trainer.stepz: unknown key"):
        load_flow("flows/quickstart.yaml", ["trainer.stepz=3"])


def test_missing_file():
    with pytest.raises(FlowError, match="flow file not found"):
        load_flow("flows/nope.yaml")


def test_cli_reports_bad_flow(tmp_path):
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main

    res = CliRunner().invoke(main, ["run", "flows/quickstart.yaml", "--set", "rollout.level=sideways", "--out", str(tmp_path)])
    assert res.exit_code != 0
    assert "rollout.level" in res.output and "'trajectory'" in res.output


def test_cli_refuses_to_mix_runs_in_one_out_dir(tmp_path):
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    res = CliRunner().invoke(main, ["run", "flows/quickstart.yaml", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "already holds a run" in res.output and "--resume" in res.output


def test_validators_check_and_one_pass_normalises(monkeypatch):
    """What a flow leaves to be derived is filled in by ``normalise`` alone: with it switched off, validation changes
    nothing (a task's declared affinity, the emulated clock, Dr. GRPO's constant stay unset)."""
    import yaml

    from rollart_dask.config import schema

    data = yaml.safe_load(open("flows/ablations/workloads/multitask.yaml"))
    overrides = ["trainer.loss_agg=constant", "emulation.time_scale=0.01"]
    cfg = load_flow(data=data, overrides=overrides)
    inject = [t for t in cfg.tasks if t.inject is not None]
    assert inject and all(t.inject["time_scale"] == 0.01 for t in inject)
    assert cfg.trainer.loss_norm_tokens == max(t.max_tokens for t in cfg.tasks)

    normalise = schema.normalise
    monkeypatch.setattr(schema, "normalise", lambda flow: flow)
    raw = load_flow(data=data, overrides=overrides)
    assert all("time_scale" not in (t.inject or {}) for t in raw.tasks) and raw.trainer.loss_norm_tokens is None
    assert normalise(raw).model_dump() == cfg.model_dump()  # the pass alone makes the difference
