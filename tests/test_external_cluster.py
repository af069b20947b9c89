"""An external multi-process cluster started with the recipes' own commands (`dask scheduler`, one
`dask worker` per pool with the tags of deploy/pools.sh): `rollart cluster check` against it, then
a tiny flow end to end, as a user attaches to a real cluster."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DASK = str(Path(sys.executable).parent / "dask")
CLI = [sys.executable, "-m", "rollart_dask.entry.cli"]
# worker name → pool of deploy/pools.sh; no SERVERLESS worker: the quickstart's rewards are local
WORKERS = {"train-0": "train", "h800-0": "h800", "h20-0": "h20", "cpu-0": "cpu", "reward-0": "reward"}


def pool_resources(pool: str) -> str:
    out = subprocess.run(
        ["bash", "-c", f"source deploy/pools.sh && pool_resources {pool}"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Stop one process we started and its children (a worker's nanny spawns the worker): its own process group."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    from distributed import Client

    logs = tmp_path_factory.mktemp("cluster-logs")
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", "OMP_NUM_THREADS": "1"}
    commands = {
        "scheduler": [DASK, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--dashboard-address", "127.0.0.1:0"]
    }
    for name, pool in WORKERS.items():
        commands[name] = [
            DASK,
            "worker",
            address,
            "--resources",
            pool_resources(pool),
            "--nthreads",
            "2",
            "--memory-limit",
            "0",
            "--name",
            name,
        ]
    procs = []
    try:
        for name, cmd in commands.items():  # cwd: the repo root, so workers import envs/ and rewards/ as in a checkout
            log = (logs / f"{name}.log").open("w")
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            if name == "scheduler":
                time.sleep(2)
        # a slow, shared box: generous timeouts; the scheduler counts the workers that joined
        with Client(address, timeout=120) as client:
            client.wait_for_workers(len(WORKERS), timeout=240)
        yield address
    except Exception:
        for log in sorted(logs.iterdir()):
            print(f"--- {log.name}\n{log.read_text()[-2000:]}")
        raise
    finally:
        for proc in reversed(procs):
            stop(proc)


def check(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "cluster", "check", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cluster_check_lists_pools_and_accepts_the_flow(scheduler):
    res = check("flows/quickstart.yaml", "--scheduler", scheduler)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in WORKERS:
        assert name in res.stdout
    for pool in ("H800", "H20", "CPU", "TRAIN", "REWARD"):
        assert pool in res.stdout
    assert "MISSING" not in res.stdout and "OK" in res.stdout
    assert "flow quickstart can run on" in res.stdout
    res = check("--scheduler", scheduler)  # no flow: the pools and their workers only
    assert res.returncode == 0 and "train-0" in res.stdout and "flow needs" not in res.stdout, res.stdout + res.stderr


def test_cluster_check_names_a_missing_pool(scheduler):
    res = check("flows/quickstart.yaml", "--scheduler", scheduler, "--set", "reward.mode=serverless")  # no SERVERLESS worker
    assert res.returncode != 0
    assert "MISSING" in res.stdout
    assert "pool SERVERLESS (reward (serverless)) has no worker" in res.stderr, res.stderr


def _state(address: str) -> dict:
    """The cluster's plugins and its Active Memory Manager, as a run may change them."""
    from distributed import Client

    from rollart_dask import compat

    with Client(address, timeout=60) as client:
        return {
            **client.run_on_scheduler(compat.plugin_names),
            "amm": client.sync(client.scheduler.amm_handler, method="running"),
            "worker_plugins": {w: sorted(p) for w, p in client.run(lambda dask_worker: list(dask_worker.plugins)).items()},
        }


@pytest.mark.slow  # (35 s: the default stage's budget is 15 minutes)
def test_quickstart_runs_on_the_external_cluster(scheduler, tmp_path):
    before = _state(scheduler)
    out = tmp_path / "run"
    tiny = [
        "--set",
        "trainer.steps=2",
        "--set",
        "eval.seeds=5",
        "--set",
        "rollout.batch_groups=2",
        "--set",
        "observe.progress=false",
        "--set",
        "observe.tensorboard=false",
    ]
    res = subprocess.run(
        [*CLI, "run", "flows/quickstart.yaml", "--scheduler", scheduler, "--out", str(out), *tiny],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 2
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if r["kind"] == "step"]
    assert [r["version"] for r in steps] == [1, 2]
    effective = yaml.safe_load((out / "flow.yaml").read_text())["_effective"]
    assert effective["engines"] == {"H800": ["h800-0"]}  # the external cluster's workers, not an embedded one
    # the cluster is left as it was found: the run's plugins unregistered, its Active Memory Manager running again
    assert before["amm"], "the test cluster's AMM should run (distributed's default), or this check proves nothing"
    assert "stopped the scheduler's Active Memory Manager" in res.stdout + res.stderr
    after = _state(scheduler)  # (the RollArt page stays, showing the finished run: it holds no model)
    after["scheduler"] = [p for p in after["scheduler"] if p != "rollart-dashboard"]
    assert after == {**before, "scheduler": [p for p in before["scheduler"] if p != "rollart-dashboard"]}
