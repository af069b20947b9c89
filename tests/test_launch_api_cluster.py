"""The Python API on the shared local cluster: launch returns at once, metrics grow, pause stops
new trajectories while those in flight finish, resume, stop drains (the last step is published,
evaluated and checkpointed)."""

import time

from distributed import Client

import rollart_dask
from tests.conftest import dropped, flow_dict, wait_for


def test_launch_pause_resume_stop_with_the_users_client(address, tmp_path):
    # env steps slowed (EMULATED latency, 0.1 s): rollout is the bottleneck, so trajectories are in flight at the pause
    task = {**flow_dict()["tasks"][0], "inject": {"step_latency": {"dist": "constant", "s": 0.1}}}
    flow = flow_dict(**{"trainer.steps": 10_000, "eval.every": 0, "tasks": [task]})
    with Client(address) as client:  # a client the user already has: the run joins its scheduler
        t0 = time.monotonic()
        run = rollart_dask.launch(flow, client=client, out=tmp_path, rollout__batch_groups=1)
        assert time.monotonic() - t0 < 5 and run.status in ("starting", "running")
        assert run.cfg.cluster.scheduler == client.scheduler.address and run.cfg.rollout.batch_groups == 1
        wait_for(lambda: len(run.metrics) >= 3, what="three training steps")
        assert {"step", "reward_mean", "loss", "tasks.frozenlake.success"} <= set(run.metrics.columns)
        assert run.metrics["step"].is_monotonic_increasing
        html = run._repr_html_()  # the notebook view: pools with their workers, the dashboard link, progress
        assert client.dashboard_link in html and "H800: " in html and "train-0" in html and "<progress" in html and "α=1" in html

        inner = run._run
        dropped_before, in_flight_before = dropped(inner), len(inner.launcher.members)  # read just before the pause
        run.pause()
        wait_for(lambda: run.status == "paused", what="pause")
        assert in_flight_before > 0  # else the checks below would hold vacuously
        wait_for(lambda: not inner.launcher.members, timeout=120, what="in-flight trajectories to finish")  # they finish, none is dropped
        opened = inner.buffer.opened
        time.sleep(2.0)  # a window to watch (nothing to wait for): an absence is shown only over time
        assert inner.buffer.opened == opened and not inner.launcher.members  # no new trajectories while paused
        assert dropped(inner) == dropped_before  # those in flight at the pause finished: none aborted, dropped or failed

        run.resume()
        wait_for(lambda: inner.buffer.opened > opened, what="new groups after resume")
        assert run.status == "running"

        result = run.stop(timeout=240)
    steps = run.metrics
    assert run.status == "finished" and result["steps"] == len(steps) >= 3
    assert result["last"]["version"] == steps["step"].iloc[-1]  # the last step was published and evaluated
    assert run.checkpoint_path and (tmp_path / "checkpoints" / "latest").exists()
    assert len(run.evals) == 2 and "eval.frozenlake.success" in run.evals.columns


def test_launch_reports_a_bad_flow_at_once_and_a_failed_run_on_wait(tmp_path):
    import pytest

    from rollart_dask.config import FlowError

    with pytest.raises(FlowError, match="rollout.alpah"):
        rollart_dask.launch(flow_dict(), out=tmp_path, rollout__alpah=2)
    run = rollart_dask.launch(flow_dict(**{"cluster.scheduler": "tcp://127.0.0.1:9"}), out=tmp_path)  # nothing listens there
    with pytest.raises(OSError, match=r"connect to tcp://127\.0\.0\.1:9") as e:
        run.wait(timeout=120)  # the run's own error (distributed's, connecting to the flow's scheduler), not a wrapper or wait's timeout
    assert not isinstance(e.value, TimeoutError)  # wait(timeout=…) raises TimeoutError, a subclass of OSError
    assert run.status == "failed" and run.error is e.value
