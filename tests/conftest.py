import asyncio
import os

import pytest

os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from rollart_dask.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models"), hidden_size=64, layers=1, heads=2, intermediate_size=128, seed=0)


def flow_dict(**over) -> dict:
    """A tiny flow for tests (2 groups of 4 per step, a few held-out seeds)."""
    data = {
        "name": "test",
        "cluster": {"workers": [
            {"name": "train-0", "pools": ["H800", "TRAIN"], "nthreads": 1},
            {"name": "h800-0", "pools": ["H800"], "nthreads": 2},
            {"name": "h20-0", "pools": ["H20"], "nthreads": 2},
            {"name": "cpu-0", "pools": ["CPU"], "nthreads": 2},
            {"name": "cpu-1", "pools": ["CPU"], "nthreads": 2},
            {"name": "serverless-0", "pools": ["SERVERLESS"], "nthreads": 1},
        ]},
        "model": {"kind": "tiny", "hidden_size": 64, "layers": 1, "heads": 2, "intermediate_size": 128},
        "engine": {"backend": "torch"},
        "tasks": [{"name": "frozenlake", "env": "frozenlake", "reward": "frozenlake", "affinity": "prefill", "max_turns": 6, "max_tokens": 2}],
        "rollout": {"mode": "rollart", "alpha": 1, "group_size": 4, "batch_groups": 2, "generate_timeout_s": 60, "env_timeout_s": 30},
        "trainer": {"steps": 2, "lr": 1e-3},
        "eval": {"every": 0, "seeds": 4},
        "observe": {"tensorboard": False, "progress": False, "watchdog_s": 60},
    }
    for key, value in over.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data


@pytest.fixture
def run_async():
    def runner(coro, timeout=300):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return runner
