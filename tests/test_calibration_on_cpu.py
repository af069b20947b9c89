"""Workload calibration without a cluster: the env-cost model on hand-computed cases, the shipped workload
holding the paper's facts (Fig. 3–6), and each fact failing when the workload breaks its premise."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from rollart_dask.entry.cli import main
from rollart_dask.tools.ablation.calibrate import FACTS, calibrate
from rollart_dask.emulation.flow_ideal import env_times

ABLATIONS = Path(FACTS).parents[1]


def test_env_times_on_hand_computed_cases():
    rng = np.random.default_rng(0)
    two = {"dist": "constant", "s": 2.0}
    reset, steps, failed = env_times({"reset_latency": two, "step_latency": two}, rng, 3, 4, retries=2)
    assert reset.tolist() == [2.0] * 3 and steps.tolist() == [[2.0] * 4] * 3 and not failed.any()
    # every reset fails after its latency: 1 + 2 retries, then the trajectory fails and takes no step
    reset, steps, failed = env_times({"reset_latency": two, "reset_fail": 1.0}, rng, 2, 4, retries=2)
    assert reset.tolist() == [6.0, 6.0] and not steps.any() and failed.all()
    # a hung reset costs its latency and the hang, cut at the call timeout; retried
    reset, _, failed = env_times({"reset_latency": two, "reset_hang_p": 1.0, "hang_s": 10}, rng, 1, 1, retries=1, timeout_s=5)
    assert reset.tolist() == [10.0] and failed.all()
    # a failed step ends its trajectory: it costs its latency, the later turns nothing
    reset, steps, failed = env_times({"step_latency": two, "step_fail": 1.0}, rng, 1, 3)
    assert reset.tolist() == [0.0] and steps.tolist() == [[2.0, 0.0, 0.0]] and failed.all()


def test_the_shipped_workload_holds_every_fact_of_the_paper():
    facts = calibrate()
    assert [f.figure for f in facts] == ["Fig. 4", "Fig. 4", "Fig. 5", "Fig. 3", "Fig. 3", "Fig. 6"]
    assert all(f.holds for f in facts), [(f.claim, f.measured) for f in facts if not f.holds]
    frozenlake, math = facts[0].values, facts[1].values
    assert frozenlake["at_load_s"]["H800"] < frozenlake["at_load_s"]["H20"] and math["at_load_s"]["H20"] < math["at_load_s"]["H800"]
    result = CliRunner().invoke(main, ["ablate", "calibrate"])
    assert result.exit_code == 0, result.output


def _copy(tmp_path: Path) -> Path:
    """The ablation files and workloads in a scratch folder, to break one premise at a time."""
    shutil.copytree(ABLATIONS, tmp_path / "ablations")
    return tmp_path / "ablations" / "workloads" / "calibration.yaml"


def _edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def _task(data: dict, name: str) -> dict:
    return next(t for t in data["tasks"] if t["name"] == name)


@pytest.mark.parametrize(
    "figure, index, change",
    [
        # FrozenLake with long answers and short observations is decode-bound: H20 generates it faster
        (
            "Fig. 4",
            0,
            lambda d: _task(d, "frozenlake")["env_args"].update(
                obs_tokens=150, output_tokens={"median": 120, "sigma": 0.5, "min": 16, "max": 2048}
            ),
        ),
        # a swe reset of a constant 20 s has no tail at all
        ("Fig. 5", 2, lambda d: _task(d, "swe")["inject"].update(reset_latency={"dist": "constant", "s": 20})),
        # steps as slow as the resets: their wave, not env.reset, dominates the rollout
        (
            "Fig. 3",
            4,
            lambda d: _task(d, "swe")["inject"].update(step_latency={"dist": "lognormal", "median_s": 3, "sigma": 1.0, "cap_s": 120}),
        ),
    ],
)
def test_a_workload_against_a_fact_fails_it(tmp_path, figure, index, change):
    facts_path = _copy(tmp_path)
    _edit(facts_path.parent / "multitask.yaml", change)
    facts = calibrate(facts_path)
    assert facts[index].figure == figure and not facts[index].holds, facts[index]


def test_failures_and_reward_cost_come_from_their_figures_scenarios(tmp_path):
    facts_path = _copy(tmp_path)
    ablations = facts_path.parents[1]
    # without the hung resets, failures barely lengthen a step (Fig. 3's 1.4× is not reached)
    _edit(ablations / "fig12b_redundancy.yaml", lambda d: d.update(set=[s for s in d["set"] if "hang" not in s]))
    # a 5 s reward keeps a dedicated reward GPU far busier than Fig. 6's 7.4%
    _edit(ablations / "fig14_reward.yaml", lambda d: d.update(set=[s.replace("reward_s=0.7", "reward_s=5") for s in d["set"]]))
    facts = calibrate(facts_path)
    assert [f.holds for f in facts] == [True, True, True, False, False, False], [(f.claim, f.measured) for f in facts]
