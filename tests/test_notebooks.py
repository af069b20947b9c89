"""The notebooks, executed headless as a user runs them (nbclient, the venv's ``python3`` kernel, cwd
notebooks/) with a tiny budget injected after their parameters cell, papermill-style; and a run
steered through the Python API from inside a notebook kernel. A cell that raises (an assert
included) fails the test with the cell and its traceback."""

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import DROPPED, flow_dict

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def with_parameters(nb, **params):
    """Insert a cell of assignments right after the cell tagged ``parameters`` (papermill's convention)."""
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()), metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(at + 1, cell)
    return nb


def execute(nb, cell_timeout=900):
    """Run every cell in a fresh ``python3`` kernel; raises CellExecutionError on the first cell that fails."""
    client = NotebookClient(
        nb, kernel_name="python3", timeout=cell_timeout, startup_timeout=120, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    return nb


def outputs(nb, mime: str) -> list[str]:
    return [o["data"][mime] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if mime in o.get("data", {})]


def code_notebook(*cells: str):
    return nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(src.strip("\n")) for src in cells],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )


@pytest.mark.parametrize("name", ["quickstart.ipynb", "ablations.ipynb"])
def test_notebooks_are_saved_without_outputs_and_take_parameters(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "save the notebook with its outputs cleared"
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and code.index(tagged[0]) == 0  # the parameters come first: nothing runs before an injection


def test_python3_kernel_is_this_virtualenv():
    nb = execute(code_notebook("import sys, rollart_dask, nbclient\nprint(sys.prefix)"), cell_timeout=120)
    assert nb.cells[0].outputs[0]["text"].strip() == sys.prefix


def test_a_run_steered_from_a_notebook_kernel(address, tmp_path):
    """launch → metrics grow → pause (no new groups, those in flight finish) → resume → stop drains;
    the same checks as test_launch_api_cluster, asserted inside the kernel's cells."""
    # env steps slowed (EMULATED latency, 0.1 s): rollout is the bottleneck, so trajectories are in flight at the pause
    task = {**flow_dict()["tasks"][0], "inject": {"step_latency": {"dist": "constant", "s": 0.1}}}
    flow = flow_dict(**{"trainer.steps": 10_000, "eval.every": 0, "tasks": [task]})
    nb = code_notebook(
        f"""
import time

from distributed import Client

import rollart_dask

ADDRESS, OUT = {address!r}, {str(tmp_path)!r}
FLOW = {flow!r}


def wait_for(cond, timeout=180.0, what="condition"):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {{what}}"
        time.sleep(0.2)


DROPPED = {DROPPED!r}  # tests/conftest.py


def dropped(run) -> dict:
    counts = {{**run.counts, **run.buffer.counts}}
    return {{k: counts.get(k, 0) for k in DROPPED}} | {{k: v for k, v in counts.items() if k.startswith("failed_")}}
""",
        """
client = Client(ADDRESS)  # a client the notebook already has: the run joins its scheduler
t0 = time.monotonic()
run = rollart_dask.launch(FLOW, client=client, out=OUT, rollout__batch_groups=1)
assert time.monotonic() - t0 < 5 and run.status in ("starting", "running"), run.status
assert run.cfg.cluster.scheduler == client.scheduler.address and run.cfg.rollout.batch_groups == 1
""",
        """
wait_for(lambda: len(run.metrics) >= 3, what="three training steps")
assert {"step", "reward_mean", "loss", "tasks.frozenlake.success"} <= set(run.metrics.columns)
assert run.metrics["step"].is_monotonic_increasing
run
""",
        """
inner = run._run
dropped_before, in_flight_before = dropped(inner), len(inner.launcher.members)  # read just before the pause
run.pause()
wait_for(lambda: run.status == "paused", what="pause")
assert in_flight_before > 0  # else the checks below would hold vacuously
wait_for(lambda: not inner.launcher.members, timeout=120, what="in-flight trajectories to finish")  # they finish, none is dropped
opened = inner.buffer.opened
time.sleep(2.0)
assert inner.buffer.opened == opened and not inner.launcher.members  # no new trajectories while paused
assert dropped(inner) == dropped_before, (dropped_before, dropped(inner))  # none aborted, dropped or failed
""",
        """
run.resume()
wait_for(lambda: inner.buffer.opened > opened, what="new groups after resume")
assert run.status == "running"
""",
        """
result = run.stop(timeout=240)
steps = run.metrics
assert run.status == "finished" and result["steps"] == len(steps) >= 3, (run.status, result["steps"], len(steps))
assert result["last"]["version"] == steps["step"].iloc[-1]  # the last step was published and evaluated
assert run.checkpoint_path and len(run.evals) == 2 and "eval.frozenlake.success" in run.evals.columns
client.close()
""",
        """
run  # the view of a finished run (its own client is closed by now)
""",
    )
    execute(nb, cell_timeout=300)
    # the handle's views, rendered by the kernel as the cells' results
    running, finished = (
        [o for o in c.outputs if o["output_type"] == "execute_result"][0]["data"]["text/html"] for c in (nb.cells[2], nb.cells[-1])
    )
    assert "rollart-dask run" in running and "<progress" in running and "H800: " in running and "train-0" in running
    assert "finished" in finished and "held-out" in finished and "dashboard" in finished
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_quickstart_notebook_with_a_tiny_budget(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    with_parameters(
        nb,
        STEPS=3,
        MINUTES=5,
        EVAL_SEEDS=5,
        EVAL_EVERY=2,
        BATCH_GROUPS=2,
        TENSORBOARD=False,
        REFRESH_S=1,
        EPISODES=2,
        OUT=str(tmp_path / "run"),
    )
    nb.cells.append(
        nbformat.v4.new_code_cell("""
assert run.status == "finished" and result["steps"] == 3, (run.status, result["steps"])
assert [int(v) for v in run.evals["step"]] == [0, 2, 3] and Path(run.checkpoint_path, "config.json").is_file()
assert len(episodes) == EPISODES and episodes["turns"].between(1, task.max_turns).all()
# the checkpoint the episodes were played with holds the trained weights, not the ones the run started from
import yaml
initial = AutoModelForCausalLM.from_pretrained(yaml.safe_load(Path(OUT, "flow.yaml").read_text())["_effective"]["model_dir"]).state_dict()
assert [k for k, v in model.state_dict().items() if not torch.equal(v, initial[k])]
assert client.status == "closed"
""")
    )
    execute(nb)
    html = "".join(outputs(nb, "text/html"))
    assert "Dashboard" in html and "rollart-dask run" in html  # the Client's view with its dashboard link, the run's view
    assert "/rollart" in html  # the RollArt page link
    assert outputs(nb, "image/png")  # the live plot
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.mark.slow  # (30 s: the default stage's budget is 15 minutes)
def test_ablations_notebook_runs_one_tiny_figure(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "ablations.ipynb", as_version=4)
    with_parameters(nb, FIGURES=["fig12a_env_level"], SCALE="tiny", OUT=str(tmp_path))
    nb.cells.append(
        nbformat.v4.new_code_cell("""
import matplotlib
table = tables["fig12a_env_level"]
assert list(tables) == ["fig12a_env_level"] and len(table) == 4 and table["paper_vs_baseline"].notna().all()
assert (table["ours"] > 0).all() and (table["ideal"] > 0).all()
assert "inline" in matplotlib.get_backend()  # writing results.png left the kernel's plotting backend alone
""")
    )
    execute(nb)
    assert outputs(nb, "image/png") and "paper_vs_baseline" in "".join(outputs(nb, "text/html"))
    assert (tmp_path / "fig12a_env_level" / "results.png").stat().st_size > 5000
