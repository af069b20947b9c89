"""`rollart cluster check`'s logic on scheduler snapshots (no cluster)."""

from rollart_dask.resource.check import ANY_ENGINE, check_cluster, pools_table
from rollart_dask.config import load_flow
from tests.conftest import flow_dict

BIG = 1_000_000


def info(**workers) -> dict:
    """A scheduler identity snapshot: worker name → its pool tags."""
    return {
        "workers": {
            f"tcp://10.0.0.{i}:4000": {"name": name, "nthreads": 2, "resources": {p: BIG for p in pools}}
            for i, (name, pools) in enumerate(workers.items())
        }
    }


FULL = {"train_0": ["H800", "TRAIN"], "h800_0": ["H800"], "h20_0": ["H20"], "cpu_0": ["CPU"], "reward_0": ["SERVERLESS", "REWARD"]}


def rows_by_pool(rows):
    return {r.pool: r for r in rows}


def test_a_complete_cluster_runs_the_flow():
    rows, problems = check_cluster(info(**FULL), load_flow(data=flow_dict()))
    assert problems == []
    by = rows_by_pool(rows)
    assert [w[0] for w in by["H800"].workers] == ["h800_0", "train_0"] and by["H800"].workers[0][2] == 2
    assert by["H800"].ok and by["CPU"].ok and by["TRAIN"].ok and by["REWARD"].ok
    assert by["H20"].need is None and by["SERVERLESS"].need is None  # listed, not needed by this flow


def test_missing_pools_are_named_with_the_reason():
    cl = {k: v for k, v in FULL.items() if k not in ("cpu_0", "h800_0")}  # H800 left only on the trainer's worker
    rows, problems = check_cluster(info(**cl), load_flow(data=flow_dict()))
    assert not rows_by_pool(rows)["CPU"].ok and not rows_by_pool(rows)["H800"].ok
    text = "; ".join(problems)
    assert "pool CPU (env hosts) has no worker" in text
    assert "pool H800 (engine for task frozenlake (affinity prefill)) has no worker (its workers host the trainer" in text


def test_affinity_any_needs_some_engine_pool():
    cfg = load_flow(data=flow_dict(tasks=[{"name": "fl", "env": "frozenlake", "reward": "frozenlake", "affinity": "any"}]))
    rows, problems = check_cluster(info(**FULL), cfg)
    assert problems == [] and rows_by_pool(rows)["H800"].ok and rows_by_pool(rows)["H20"].ok
    cl = {k: v for k, v in FULL.items() if k not in ("h800_0", "h20_0")}
    rows, problems = check_cluster(info(**cl), cfg)
    assert rows_by_pool(rows)[ANY_ENGINE].ok is False and problems == [
        f"pool {ANY_ENGINE} (engine for task fl (affinity any)) has no worker"
    ]


def test_stateful_rewards_need_the_reward_pool_even_when_serverless():
    task = {"name": "m", "env": "math", "reward": "judge", "affinity": "decode"}
    cfg = load_flow(data=flow_dict(**{"tasks": [task], "reward.mode": "serverless"}))
    cl = {**{k: v for k, v in FULL.items() if k != "reward_0"}, "fn_0": ["SERVERLESS"]}
    _, problems = check_cluster(info(**cl), cfg)
    assert problems == ["pool REWARD (stateful reward judge) has no worker"]


def test_without_a_flow_every_tag_is_listed_including_unknown_ones():
    rows, problems = check_cluster(info(**FULL, typo_0=["h800"]))
    assert problems == [] and all(r.need is None and r.ok is None for r in rows)
    assert [r.pool for r in rows] == ["H800", "H20", "CPU", "SERVERLESS", "TRAIN", "REWARD", "h800"]
    assert pools_table(rows, "t").columns[-1].header == "threads"  # no flow columns
