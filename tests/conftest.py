import asyncio
import functools
import importlib
import os
import platform
import shutil
import time

import pytest

os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
os.environ.setdefault("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "False")


# -- declared dependencies: skipped where missing, except in CI on x86-64 ----------------------------------
def in_ci() -> bool:
    """CI is set (GitHub and most CI systems set CI=true); 0 / false / no count as unset. The Makefile agrees."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def strict_dependencies() -> bool:
    """In CI on x86-64 `make test` installs every declared dependency (.ci/system-deps, the Makefile's vllm
    and mooncake extras), so one that is missing there is a broken install: the test fails instead of skipping."""
    return in_ci() and platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=None)
def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _why_missing(name: str) -> str | None:
    """None when the dependency is here, else why a test that needs it cannot run."""
    if name == "vllm":
        err = _import_error("vllm")
        return err and f"the vllm extra is not installed (make installs it on x86-64; {err})"
    if name == "chromium":
        return (
            None
            if os.path.exists("/usr/bin/chromium")
            else "no /usr/bin/chromium (Debian's chromium package; `make test` installs it in CI)"
        )
    if name == "dockerd":
        return None if shutil.which("dockerd") else "dockerd is not installed (Debian: apt-get install -y docker.io)"
    if name == "libibverbs":  # the Mooncake store's wheel loads Debian's libibverbs1 even over TCP
        err = _import_error("mooncake.store")
        return err and f"mooncake.store does not import: the mooncake extra and Debian's libibverbs1 are needed ({err})"
    raise ValueError(f"unknown dependency {name!r} (known: vllm, chromium, dockerd, libibverbs)")


def require(name: str) -> None:
    """Skip the calling test (or fixture) when the declared dependency ``name`` is missing; in CI on
    x86-64 fail it instead, naming what is missing. Tests use it through ``@pytest.mark.needs(name)``."""
    why = _why_missing(name)
    if why is None:
        return
    if strict_dependencies():
        pytest.fail(f"CI on x86-64 must not skip: {why}", pytrace=False)
    pytest.skip(why)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs(name): the test needs the declared dependency vllm | chromium | dockerd | libibverbs "
        "(skipped where missing; a failure in CI on x86-64)",
    )


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        for name in mark.args:
            require(name)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from rollart_dask.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models"), hidden_size=64, layers=1, heads=2, intermediate_size=128, seed=0)


def flow_dict(**over) -> dict:
    """A tiny flow for tests (2 groups of 4 per step, a few held-out seeds)."""
    data = {
        "name": "test",
        "cluster": {
            "workers": [
                {"name": "train-0", "pools": ["H800", "TRAIN"], "nthreads": 1},
                {"name": "h800-0", "pools": ["H800"], "nthreads": 2},
                {"name": "h20-0", "pools": ["H20"], "nthreads": 2},
                {"name": "cpu-0", "pools": ["CPU"], "nthreads": 2},
                {"name": "cpu-1", "pools": ["CPU"], "nthreads": 2},
                {"name": "reward-0", "pools": ["SERVERLESS", "REWARD"], "nthreads": 1},
            ]
        },
        "model": {"kind": "tiny", "hidden_size": 64, "layers": 1, "heads": 2, "intermediate_size": 128},
        "engine": {"backend": "torch"},
        "tasks": [
            {"name": "frozenlake", "env": "frozenlake", "reward": "frozenlake", "affinity": "prefill", "max_turns": 6, "max_tokens": 2}
        ],
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


# What the buffer and the run count for a trajectory or group that does not finish (rollart_dask/control/buffer.py,
# the run's failed_<error> and abort_errors): a pause must leave all of them as they were.
DROPPED = ("aborted_stale", "evicted_stale", "redundant_dropped", "groups_dropped", "failed", "late", "worker_lost", "abort_errors")


def dropped(run) -> dict:
    """Those counts of a run (control/run.py's Run), read from any thread."""
    counts = {**run.counts, **run.buffer.counts}
    return {k: counts.get(k, 0) for k in DROPPED} | {k: v for k, v in counts.items() if k.startswith("failed_")}


def record_trained_batches(run, into: list | None = None) -> list:
    """Record every batch the run's buffer hands to training, in order, as the policy versions the engines
    stamped on each kept trajectory's turns (``Turn.version``, from each ``Completion``) — not the buffer's own
    start version, nor the ``published`` value it filtered on. Returns the list it appends to."""
    batches = [] if into is None else into
    take = run.buffer.take

    def recording(n_groups):
        groups = take(n_groups)
        if groups is not None:
            # per turn its version; a turn continued across versions (rollout.partial=continue): its first and last token's
            batches.append(
                [
                    [
                        v
                        for turn in traj.turns
                        for v in (turn.token_versions[:: len(turn.token_versions) - 1 or 1] if turn.token_versions else [turn.version])
                    ]
                    for g in groups
                    for traj in g.kept
                ]
            )
        return groups

    run.buffer.take = recording
    return batches


def check_staleness_by_turns(batches: list, step_rows: list[dict], alpha: int) -> int:
    """Each step row's ``version`` is what its Train produced (the trainer's own count), so the batch trained at
    n = version − 1. Every trajectory in it must have started (its first turn) at ≥ n − α, its turns never run
    ahead of the trainer nor go back in version. Returns how many trajectories span a weight swap."""
    rows = sorted(step_rows, key=lambda r: r["version"])
    assert len(batches) == len(rows) and batches, (len(batches), len(rows))
    spanning = 0
    for turns, row in zip(batches, rows):
        n = row["version"] - 1
        assert turns and all(turns), f"step v{row['version']}: a batch or trajectory without turns"
        for versions in turns:
            assert versions == sorted(versions), f"turn versions go backwards: {versions}"
            assert versions[0] >= n - alpha, f"trained at v{n} (α={alpha}) a trajectory started at v{versions[0]}: turns {versions}"
            assert versions[-1] <= n, f"a turn at v{versions[-1]} trained at v{n}: engines ahead of the trainer"
            spanning += len(set(versions)) > 1
    return spanning


# -- waiting for an event, not a fixed time ------------------------------------------------------------------
def wait_for(cond, timeout: float = 180.0, what: str = "condition", every: float = 0.05):
    """Poll ``cond`` until it returns something true (returned), failing after ``timeout`` s naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(every)
    return value


async def await_for(cond, timeout: float = 180.0, what: str = "condition", every: float = 0.05):
    """``wait_for`` inside a loop: ``cond`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        await asyncio.sleep(every)


@pytest.fixture
def run_async():
    def runner(coro, timeout=300):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return runner


@pytest.fixture(scope="session")
def address():
    """One local cluster with every pool for the runtime tests, reached by address (the attach path)."""
    from distributed import Client, SpecCluster

    from rollart_dask.resource.cluster import cluster_spec
    from rollart_dask.config import load_flow

    spec = cluster_spec(load_flow(data=flow_dict()).cluster)
    with SpecCluster(workers=spec["workers"], scheduler=spec["scheduler"], silence_logs=40) as cluster:
        with Client(cluster) as c:
            c.wait_for_workers(len(spec["workers"]), timeout=120)
        yield cluster.scheduler_address


async def start_run(cfg, out, model_dir):
    from rollart_dask.resource.cluster import connect
    from rollart_dask.control.run import Run
    from rollart_dask.serve.lambda_local import start_local_endpoint

    client, cluster = await connect(cfg.cluster)
    run = Run(cfg, client, out, model_dir, start_endpoint=start_local_endpoint)
    await run.setup()
    return run, client, cluster


async def close(run, client, cluster):
    await run.stop()
    await client.close()
    if cluster is not None:
        await cluster.close()
