"""The RollArt dashboard's data path without a cluster: the snapshot a run publishes, its merge on
the scheduler side, what each panel plots; and the span / task-key helpers behind the phase spans."""

from collections import Counter
from types import SimpleNamespace

import dask
import msgpack
from dask.utils import key_split
from distributed.utils import key_split_group

from rollart_dask.control import phases
from rollart_dask.serve.dashboard import page_url
from rollart_dask.serve.dashboard.panels import panel_data
from rollart_dask.serve.dashboard.plugin import MAX_RUNS, RunState, merge_event
from rollart_dask.control.snapshot import TAIL, build_snapshot
from rollart_dask.control.phases import task_key


def fake_run(n_steps=3, t_start=100.0):
    cfg = SimpleNamespace(name="demo", rollout=SimpleNamespace(mode="rollart", alpha=1), trainer=SimpleNamespace(steps=10))
    rows = [{"kind": "eval", "step": 0, "version": 0}]
    for i in range(1, n_steps + 1):
        rows.append(
            {
                "kind": "step",
                "step": i,
                "version": i,
                "elapsed_s": 10.0 * i,
                "pool_busy": {"H800": 0.5, "CPU": 0.25, "TRAIN": 0.9},
                "staleness": {"0": 6, "1": 2},
                "lag_hist": {"in_flight": {"0": 5, "1": 3}, "in_queue": {"0": 7, "1": 1}},  # (summing to the staleness)
                "mix": {"launched": {"math": 0.5, "swe": 0.5}, "trained": {"math": 0.5 + 0.1 / i, "swe": 0.5 - 0.1 / i}},
            }
        )
    syncs = [
        {"at": t_start - 5, "from": 0, "version": 1, "suspend_s": 0.1, "update_s": 0.2, "recompute_kv_s": 0.05}
    ]  # warm start, before t0
    syncs += [
        {"at": t_start + 10.0 * i + 1, "from": i, "version": i + 1, "suspend_s": 0.1, "update_s": 0.3, "recompute_kv_s": 0.01}
        for i in range(1, n_steps)
    ]
    history = [
        {"version": 1, "elapsed_s": 2.0, "eval": {"frozenlake": {"success": 0.25}, "sokoban": {"success": 0.0}}},
        {"version": n_steps, "elapsed_s": 40.0, "eval": {"frozenlake": {"success": 0.5}, "sokoban": {"success": 0.125}}},
    ]
    return SimpleNamespace(
        cfg=cfg,
        run_id="demo-1234",
        status=SimpleNamespace(t_start=t_start),
        published=n_steps,
        state="running",
        engine_version=n_steps,
        in_flight=lambda: Counter({"generate": 2, "env-step": 1, "reward": 1}),
        buffer=SimpleNamespace(counts=Counter(aborted_stale=2, redundant_dropped=3, failed=1, worker_lost=1, finished=40, late=5)),
        metrics=SimpleNamespace(rows=rows),
        history=history,
        syncs=syncs,
        services=SimpleNamespace(proxy=SimpleNamespace(requests=17 * n_steps)),
        telemetry=SimpleNamespace(reward_totals=Counter(calls=12 * n_steps, throttles=2, cold_starts=1)),
    )


def test_snapshot_is_a_small_serialisable_view_of_the_run():
    run = fake_run()
    snap = build_snapshot(run, now=145.0)
    assert msgpack.unpackb(msgpack.packb(snap), strict_map_key=False) == snap  # what log_event requires
    assert snap["run"] == "demo-1234" and snap["status"] == "running" and snap["t"] == 45.0
    assert snap["inflight"] == {"generate": 2, "env-step": 1, "reward": 1}
    assert snap["counts"]["failed"] == 2 and snap["counts"]["redundant_dropped"] == 3 and "late" not in snap["counts"]
    assert [s["step"] for s in snap["steps"]] == [1, 2, 3] and snap["steps"][0]["busy"]["H800"] == 0.5
    assert snap["syncs"][0]["t"] == -5.0 and snap["syncs"][1] == {
        "t": 11.0,
        "from": 1,
        "version": 2,
        "suspend_s": 0.1,
        "update_s": 0.3,
        "recompute_kv_s": 0.01,
    }
    assert snap["evals"][-1]["success"] == {"frozenlake": 0.5, "sokoban": 0.125}
    assert snap["totals"] == {"generate_calls": 51, "reward_calls": 36, "reward_throttles": 2, "reward_cold_starts": 1}
    run.state = "paused"
    assert build_snapshot(run)["status"] == "paused" and build_snapshot(run, final=True)["status"] == "ended"
    long = build_snapshot(fake_run(n_steps=200))  # a long run's message stays bounded
    assert len(long["steps"]) == TAIL and long["steps"][-1]["step"] == 200 and len(msgpack.packb(long)) < 8000


def test_scheduler_side_merges_snapshots_by_key_and_keeps_recent_runs():
    runs: dict = {}
    early, late = build_snapshot(fake_run(n_steps=40)), build_snapshot(fake_run(n_steps=60))
    for msg in (early, late, early, {"not": "a snapshot"}, "noise"):  # repeated, out of order, foreign events
        merge_event(runs, msg)
    state = runs["demo-1234"]
    assert sorted(state.steps) == list(range(40 - TAIL + 1, 61))  # both tails, once each
    assert state.latest["published"] == 40 and "steps" not in state.latest  # gauges: the last message received
    for i in range(MAX_RUNS + 2):
        merge_event(runs, dict(early, run=f"other-{i}"))
    assert len(runs) == MAX_RUNS and "demo-1234" not in runs


def test_panels_plot_the_merged_state():
    state = RunState()
    state.merge(build_snapshot(fake_run(), now=145.0))
    d = panel_data(state)
    inflight = dict(zip(d["inflight"]["stage"], d["inflight"]["n"]))
    assert inflight["generate"] == 2 and inflight["env-wait"] == 0 and d["inflight"]["stage"][0] == "env-wait"
    busy = dict(zip(d["busy"]["name"], d["busy"]["ys"]))
    assert busy["TRAIN"] == [0.9, 0.9, 0.9] and d["busy"]["xs"][0] == [10.0, 20.0, 30.0]
    assert d["staleness"] == {"x": [0, 1], "n": [18, 6]}  # summed over the steps
    assert d["lag"] == {"x": [0, 1], "in_flight": [15, 9], "in_queue": [21, 3]} and d["summary"]["lag"] == 24  # its two parts
    assert d["version"]["version"][:2] == [0, 1] and d["version"]["t"][0] == -5.0  # from the warm start's version
    assert d["suspend"]["x0"][1] == 11.0 and d["update"]["x0"][1] == 11.1 and d["resume"]["t"][1] == 11.4
    assert d["version"]["t"][-1] == 45.0 and d["version"]["version"][-1] == 3  # held until now
    assert dict(zip(d["counts"]["what"], d["counts"]["n"]))["aborted_stale"] == 2
    assert dict(zip(d["scores"]["name"], d["scores"]["ys"]))["frozenlake"] == [0.25, 0.5]
    assert dict(zip(d["mix"]["name"], d["mix"]["ys"]))["swe"] == [-10.0, -5.0, -3.33]  # trained − launched, pp, per step
    assert d["summary"]["mix_shift_pp"] == 3.33  # the latest gap
    s = d["summary"]
    assert (s["inflight"], s["busy_points"], s["staleness"], s["syncs"], s["evals"], s["step"]) == (4, 9, 24, 3, 2, 3)
    empty = panel_data(None)  # the page before any run published
    assert empty["summary"]["status"] == "waiting for a run" and empty["counts"]["what"] and not empty["busy"]["name"]


def test_summary_header_escapes_and_carries_data_attributes():
    from rollart_dask.serve.dashboard.page import summary_html

    s = dict(panel_data(None)["summary"], run="<x>", inflight=7)
    html = summary_html(s)
    assert 'data-inflight="7"' in html and 'data-busy-points="0"' in html and "&lt;x&gt;" in html and "<x>" not in html


def test_page_url_from_the_dashboard_link():
    assert page_url("http://127.0.0.1:8787/status") == "http://127.0.0.1:8787/rollart"
    assert page_url("https://hub/user/me/proxy/8787/status") == "https://hub/user/me/proxy/8787/rollart"
    assert page_url(None) is None


def test_task_keys_group_by_stage_and_span():
    assert isinstance(task_key("generate"), str) and task_key("generate").rsplit("-", 1)[0] == "generate"  # outside any span: as before
    step = phases.new_span("rollart", "step-3")
    with phases.phase(step, "train"):
        ann = dask.get_annotations()["span"]
        k1, k2 = task_key("train"), task_key("train")
    with phases.phase(phases.new_span("rollart", "step-4"), "train"):
        k3 = task_key("train")
    assert ann["name"] == ("rollart", "step-3", "train") and ann["ids"][:2] == step["ids"]
    assert key_split(k1) == key_split(k3) == "train"  # the task stream still colours by stage
    assert key_split_group(k1) == key_split_group(k2) != key_split_group(k3)  # one TaskGroup per (stage, span)
    with phases.phase(step, "update-weights"):
        assert key_split(task_key("update-weights")) == "update-weights"
    with phases.phase(None, "suspend"):  # outside a step (set-up's weight sync)
        assert dask.get_annotations()["span"]["name"] == ("rollart", "suspend")
    with phases.within(None):
        assert "span" not in dask.get_annotations()
    run = phases.new_span("rollart")
    nested = phases.new_span("step-1", parent=run)  # a step nests in the run's span, entered or not
    assert nested["name"] == ("rollart", "step-1") and nested["ids"][0] == run["ids"][0]


def test_the_runs_figures_are_prometheus_series_with_the_run_and_flow_as_labels():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from rollart_dask.serve.dashboard.prometheus import RollartCollector

    runs: dict = {}
    for msg in (build_snapshot(fake_run(n_steps=2)), build_snapshot(fake_run(n_steps=3))):
        merge_event(runs, msg)
    collector = RollartCollector()
    collector.sources.append(runs)
    registry = CollectorRegistry()
    registry.register(collector)
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "flow")))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    assert all(name.startswith("rollart_") for name, _ in samples)
    assert samples["rollart_version", ()] == 3 and samples["rollart_up", (("status", "running"),)] == 1
    assert samples["rollart_turns_total", ()] == 51 and samples["rollart_reward_calls_total", ()] == 36
    assert samples["rollart_reward_throttles_total", ()] == 2 and samples["rollart_reward_cold_starts_total", ()] == 1
    assert samples["rollart_trajectories_total", (("outcome", "aborted_stale"),)] == 2
    assert samples["rollart_trajectories_in_flight", (("stage", "env-step"),)] == 1
    assert samples["rollart_staleness_samples", (("staleness", "1"),)] == 2 and samples["rollart_pool_busy", (("pool", "TRAIN"),)] == 0.9
    assert samples["rollart_held_out_success", (("task", "sokoban"),)] == 0.125 and samples["rollart_held_out_version", ()] == 3
    labels = next(s.labels for fam in text_string_to_metric_families(generate_latest(registry).decode()) for s in fam.samples)
    assert labels["run"] == "demo-1234" and labels["flow"] == "demo"
