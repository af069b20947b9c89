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
            {"name": "reward-0", "pools": ["SERVERLESS", "REWARD"], "nthreads": 1},
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


@pytest.fixture(scope="session")
def address():
    """One local cluster with every pool for the runtime tests, reached by address (the attach path)."""
    from distributed import Client, SpecCluster

    from rollart_dask.cluster import cluster_spec
    from rollart_dask.config import load_flow

    spec = cluster_spec(load_flow(data=flow_dict()).cluster)
    with SpecCluster(workers=spec["workers"], scheduler=spec["scheduler"], silence_logs=40) as cluster:
        with Client(cluster) as c:
            c.wait_for_workers(len(spec["workers"]), timeout=120)
        yield cluster.scheduler_address


async def start_run(cfg, out, model_dir):
    from rollart_dask.cluster import connect
    from rollart_dask.loop import Run

    client, cluster = await connect(cfg.cluster)
    run = Run(cfg, client, out, model_dir)
    await run.setup()
    return run, client, cluster


async def close(run, client, cluster):
    await run.stop()
    await client.close()
    if cluster is not None:
        await cluster.close()
