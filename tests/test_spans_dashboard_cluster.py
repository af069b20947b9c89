"""Dask-native observability of a short run on the shared local cluster: the scheduler has a span per
training step with the protocol's phases inside it (so fine performance metrics attribute time per
phase), rollout and evaluation in spans of their own, task keys named by stage, and the RollArt
page's plugin holding what the run published."""

import time
import urllib.request

from distributed import Client, get_task_stream

import rollart_dask
from tests.conftest import flow_dict, wait_for

STAGES = {
    "preflight",
    "generate",
    "env-reset",
    "env-step",
    "env-close",
    "reward",
    "abort",
    "update-weights",
    "reset-prefix-cache",
    "train",
    "train-batch",
    "publish-weights",
    "weights-bucket",
    "stage-weights",
    "checkpoint",
    "restore",
    "warmstart",
    "warmstart-demos",
}
ROLLOUT_BATCHES = {"generate", "env-reset", "env-step", "reward"}  # rollout's pinned calls: in the run's span
ENGINE_BATCHES = {"update-weights", "reset-prefix-cache"}  # the engines' control calls: in the step's span
PHASES = {"get-batch", "wait-train", "pull-weights", "suspend", "update-weights", "resume", "recompute-kv", "train", "eval"}


def stage_of(key) -> str:
    """``stage-<id>`` or, inside a span, ``("stage-<span id>", "<id>")`` → stage."""
    return (key[0] if isinstance(key, tuple) else key).rsplit("-", 1)[0]


def spans_since(dask_scheduler, t0):
    """(name, task prefixes) of every span the scheduler learnt about since t0."""
    ext = dask_scheduler.extensions["spans"]
    return [(s.name, sorted({tg.prefix.name for tg in s.groups})) for s in ext.spans.values() if s.enqueued >= t0]


def batch_seconds_since(dask_scheduler, t0):
    """Seconds of the run's pinned batches (no Dask tasks: reported by the workers), span name → stage → seconds."""
    out: dict = {}
    for s in dask_scheduler.extensions["spans"].spans.values():
        if s.enqueued >= t0 and s.name[0] == "rollart":
            for (context, prefix, activity, _unit), v in s._cumulative_worker_metrics.items():
                if context == "execute" and activity == "rollart-batch":
                    out.setdefault(s.name, {})[prefix] = out.get(s.name, {}).get(prefix, 0.0) + v
    return out


def transitions_since(dask_scheduler, t0):
    return [t.key for t in dask_scheduler.transition_log if t.timestamp >= t0]


def dashboard_state(dask_scheduler, run_id):
    state = dask_scheduler.plugins["rollart-dashboard"].runs[run_id]
    return {"steps": sorted(state.steps), "syncs": sorted(state.syncs), "evals": sorted(state.evals), "status": state.latest["status"]}


def test_phase_spans_stage_keys_and_the_rollart_page(address, tmp_path):
    with Client(address) as client:
        t0 = client.run_on_scheduler(time.time)
        with get_task_stream(client) as stream:
            run = rollart_dask.launch(flow_dict(**{"trainer.steps": 3}), client=client, out=tmp_path)
            result = run.wait(timeout=300)

            def batches_reported():  # the workers report their batches (no Dask tasks) about once a second
                seconds = client.run_on_scheduler(batch_seconds_since, t0=t0)
                ok = ROLLOUT_BATCHES <= set(seconds.get(("rollart",), {})) and ENGINE_BATCHES <= set(seconds.get(("rollart", "step-2"), {}))
                return seconds if ok else None

            batch_seconds = wait_for(batches_reported, timeout=30, what="the workers' batch reports")
        assert result["steps"] == 3
        spans = client.run_on_scheduler(spans_since, t0=t0)
        keys = client.run_on_scheduler(transitions_since, t0=t0)
        state = client.run_on_scheduler(dashboard_state, run_id=run._run.run_id)
        url = run.dashboard_url
        assert url and url == client.dashboard_link.rsplit("/status", 1)[0] + "/rollart"
        with urllib.request.urlopen(url, timeout=30) as page:  # the Bokeh page renders a session for a browser
            assert page.status == 200 and "bokeh" in page.read().decode().lower()

    by_name = {name: prefixes for name, prefixes in spans}
    assert [name for name, _ in spans].count(("rollart",)) == 1  # one root span for the run, everything under it
    for step in (1, 2, 3):  # one span per step, the Train of each in its own step (not all in the first's)
        assert by_name[("rollart", f"step-{step}", "train")] == ["train"]
    assert by_name[("rollart", "step-2", "wait-train")] == ["publish-weights", "stage-weights", "weights-bucket"]
    # rollout's calls and the engines' control calls go straight to their workers (no Dask tasks): their time is in
    # the deepest of their spans the scheduler knows all the same (a phase span holding no task is not one of them)
    assert ROLLOUT_BATCHES <= set(batch_seconds[("rollart",)]), batch_seconds
    assert ENGINE_BATCHES <= set(batch_seconds[("rollart", "step-2")]), batch_seconds
    assert all(v > 0 and stage in STAGES for stages in batch_seconds.values() for stage, v in stages.items()), batch_seconds
    # (evaluation has a span too, but its calls may all have joined coalesced batches opened by rollout)
    for name, prefixes in spans:
        if name[0] != "rollart":
            continue
        if len(name) == 3:
            assert name[1].startswith("step-") and name[2] in PHASES, name
        assert set(prefixes) <= STAGES, (name, prefixes)

    # task keys start with their stage, in the task stream and in the transition log
    assert stream.data and all(stage_of(t["key"]) in STAGES for t in stream.data)
    assert keys and all(stage_of(k) in STAGES for k in keys)
    assert {stage_of(t["key"]) for t in stream.data} >= {
        "generate",
        "env-step",
        "reward",
        "train",
        "publish-weights",
        "stage-weights",
        "update-weights",
    }

    # the page's plugin merged every step, weight sync and evaluation the run published, and its end
    assert state["steps"] == [1, 2, 3] and state["syncs"] == [1, 2, 3] and state["evals"] == [0, 3] and state["status"] == "ended"
