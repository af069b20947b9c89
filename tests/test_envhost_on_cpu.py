"""The env host when calls of one trajectory overlap (data/envhost.py): a reset retried after a timeout runs
beside the attempt that timed out, and a close comes while a step is running. No env may leak, the env kept
must be the one whose observation the control plane got, and a close must not pull an env from under a step."""

import threading

import pytest

from rollart_dask.data.envhost import EnvHost, Superseded

ENV = f"{__name__}:GateEnv"  # 'module:attr' names user code the host imports


class GateEnv:
    """An env whose first reset and whose step "slow" wait for the test to open a gate."""

    instances: list["GateEnv"] = []
    reset_entered, reset_gate = threading.Event(), threading.Event()
    step_entered, step_gate = threading.Event(), threading.Event()

    def __init__(self):
        self.n, self.closed, self.closed_during_step = len(GateEnv.instances), False, False
        GateEnv.instances.append(self)

    def reset(self, seed=None):
        if self.n == 0:
            GateEnv.reset_entered.set()
            assert GateEnv.reset_gate.wait(30)
        return f"env {self.n}", {}

    def step(self, action):
        if action == "slow":
            GateEnv.step_entered.set()
            assert GateEnv.step_gate.wait(30)
            self.closed_during_step = self.closed
        return f"env {self.n} after {action}", 0.0, False, False, {}

    def close(self):
        self.closed = True


@pytest.fixture
def host():
    GateEnv.instances.clear()
    for gate in (GateEnv.reset_entered, GateEnv.reset_gate, GateEnv.step_entered, GateEnv.step_gate):
        gate.clear()
    yield EnvHost(threads=4)


def reset(host, tid, attempt):
    return host.reset({"traj_id": tid, "env": ENV, "seed": 0, "attempt": attempt})


def test_a_retried_reset_keeps_the_env_it_answered_with_and_leaks_none(host):
    first = host.pool.submit(reset, host, "t", 0)  # times out at the control plane…
    assert GateEnv.reset_entered.wait(30)
    obs, _ = reset(host, "t", 1)  # … which retries while it still runs
    GateEnv.reset_gate.set()
    with pytest.raises(Superseded):
        first.result(30)
    assert obs == "env 1"
    assert host.step({"traj_id": "t", "action": "up"})[0] == "env 1 after up"  # the env the observation came from
    assert [e.n for e in GateEnv.instances if not e.closed] == [1], "an env leaked"


def test_a_close_waits_for_the_step_in_progress(host):
    GateEnv.reset_gate.set()  # env 0's reset would wait for it
    reset(host, "t", 0)
    step = host.pool.submit(host.step, {"traj_id": "t", "action": "slow"})
    assert GateEnv.step_entered.wait(30)
    close = host.pool.submit(host.close, "t")
    with pytest.raises(TimeoutError):
        close.result(0.3)  # still waiting for the step
    GateEnv.step_gate.set()
    assert step.result(30)[0] == "env 0 after slow"
    close.result(30)
    (env,) = GateEnv.instances
    assert env.closed and not env.closed_during_step


def test_a_reset_after_the_close_is_refused_and_leaks_nothing(host):
    GateEnv.reset_gate.set()
    host.close("gone")
    with pytest.raises(Superseded, match="closed"):
        reset(host, "gone", 0)
    assert all(e.closed for e in GateEnv.instances) and "gone" not in host.envs


def test_cluster_env_threads_bounds_the_calls_a_cpu_worker_runs_at_once():
    """cluster.env_threads reaches the CPU worker's env host (the plugin's build): with 3 threads, 8 waiting calls run
    3 at a time, never more; a flow asking for none is refused, naming the field."""
    import time

    from rollart_dask.config import FlowError, load_flow
    from rollart_dask.data.plugins import EnvHostPlugin

    cfg = load_flow("flows/quickstart.yaml", ["cluster.env_threads=3"])
    host = EnvHostPlugin(["CPU"], threads=cfg.cluster.env_threads).build()
    lock, running, most, gate = threading.Lock(), [0], [0], threading.Event()

    def call():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        assert gate.wait(30)
        with lock:
            running[0] -= 1

    calls = [host.pool.submit(call) for _ in range(8)]
    t0 = time.monotonic()
    while running[0] < 3 and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    time.sleep(0.5)  # room for a fourth to start, were there a thread for it
    assert most[0] == 3
    gate.set()
    for f in calls:
        f.result(30)
    with pytest.raises(FlowError, match="env_threads"):
        load_flow("flows/quickstart.yaml", ["cluster.env_threads=0"])
