"""rollout.deterministic end to end: two runs of one flow and seed, at once on their own embedded clusters (so their
timings differ), train the same samples in the same order to the same figures and end with bit-equal weights, for sync
(α = 0) and for α = 1. Held-out evaluations are sampled (temperature 1) so that their seeds are exercised too."""

import pytest
from distributed import Client

import rollart_dask
from rollart_dask.config import FlowError
from rollart_dask.observe import read_rows
from rollart_dask.tools.replay import compare
from tests.conftest import flow_dict


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "rollart"])
def test_two_deterministic_runs_train_the_same_samples_and_end_with_bit_equal_weights(tmp_path, mode):
    flow = flow_dict(
        **{
            "rollout.mode": mode,
            "rollout.alpha": None,
            "rollout.deterministic": True,
            "trainer.steps": 4,
            "eval.every": 2,
            "eval.temperature": 1.0,
        }
    )
    runs = [rollart_dask.launch(flow, out=tmp_path / f"run-{i}") for i in range(2)]
    results = [run.wait(timeout=600) for run in runs]
    assert [r["steps"] for r in results] == [4, 4]
    out = compare(tmp_path / "run-0", tmp_path / "run-1")
    assert out["differences"] == []
    assert (out["steps"], out["evals"]) == (4, 3)
    assert out["checkpoints"][0] is not None and len(out["checkpoints"][0]) == 64  # (compare also fails a missing one)
    steps = [r for r in read_rows(tmp_path / "run-0" / "metrics.jsonl") if r["kind"] == "step"]
    assert len({r["sha256"] for r in steps}) == 4  # four different batches, each replayed
    assert {max(map(int, r["staleness"])) for r in steps} == ({0} if mode == "sync" else {0, 1})


def test_a_deterministic_flow_refuses_a_users_client(address, tmp_path):
    with Client(address) as client, pytest.raises(FlowError, match="rollout.deterministic with a client's cluster"):
        rollart_dask.launch(flow_dict(**{"rollout.deterministic": True}), client=client, out=tmp_path)
