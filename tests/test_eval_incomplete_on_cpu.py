"""Held-out evaluation whose calls fail (no cluster): failed seeds are played again in rounds, the figures are over the
seeds that completed, and an evaluation left incomplete is never shown, plotted or logged as a score anywhere."""

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rollart_dask.algo.heldout import incomplete_note, is_complete, loggable, played_as, shown, summarise
from rollart_dask.control.evaluation import play
from rollart_dask.control.proxy import TrajectoryCancelled
from rollart_dask.types import Trajectory

TIMEOUT = TimeoutError("generate on tcp://127.0.0.1:4000 gave no answer in 60s\nsecond line")


class FakeEM:
    """em.run that fails a seed's first ``failures[seed]`` plays (None: every play) with ``error``; a seed in ``wins``
    succeeds, any other ends with a wrong answer (an outcome, not a failure)."""

    def __init__(self, failures: dict, wins=(), error=TIMEOUT):
        self.failures, self.wins, self.error, self.ids, self.temperatures = dict(failures), set(wins), error, [], []

    async def run(self, traj: Trajectory, task, eval_temperature: float | None = None) -> Trajectory:
        self.ids.append(traj.id)
        self.temperatures.append(eval_temperature)
        await asyncio.sleep(0)
        left = self.failures.get(traj.seed, 0)
        if left is None or left > 0:
            if left is not None:
                self.failures[traj.seed] = left - 1
            raise self.error
        traj.reward = 1.0 if traj.seed in self.wins else 0.0
        traj.info = {"reward": {"success": traj.seed in self.wins}}
        return traj


class Task:
    name = "lake"


def played(em, seeds=range(4), retries=2):
    return asyncio.run(play(em, Task(), seeds, "t", retries=retries))


def test_failed_seeds_are_retried_in_rounds_with_fresh_ids_and_the_evaluation_completes():
    em = FakeEM({1: 1, 3: 2}, wins={0, 1})
    fig, outcomes = played(em)
    assert fig["complete"] and fig["completed"] == fig["seeds"] == 4 and fig["failed_calls"] == 0 and fig["failures"] == {}
    assert fig["retried"] == 2 and fig["success"] == 0.5 and sorted(outcomes) == [0, 1, 2, 3]
    assert len(em.ids) == 4 + 2 + 1 and len(set(em.ids)) == len(em.ids)  # a round's ids are new (the env host refuses a closed one's)
    assert is_complete(fig) and shown(fig) == "0.500"


def test_a_seed_still_failing_makes_it_incomplete_with_its_reason_and_figures_over_the_completed_seeds():
    em = FakeEM({2: None, 3: None}, wins={0})
    fig, outcomes = played(em)
    assert not fig["complete"] and fig["completed"] == 2 and fig["failed_calls"] == 2 and fig["seeds"] == 4 and sorted(outcomes) == [0, 1]
    assert fig["success"] == 0.5 and fig["reward_mean"] == 0.5  # over the seeds that completed, not a failure counted as no success
    assert fig["failures"] == {"TimeoutError: generate on tcp://127.0.0.1:4000 gave no answer in 60s": 2}  # type and first line, grouped
    assert sum(i.endswith("-2") or "-2~" in i for i in em.ids) == 3  # played 1 + retries times
    text = shown(fig)
    assert text == "incomplete: 2 of 4 eval calls failed (TimeoutError: generate on tcp://127.0.0.1:4000 gave no answer in 60s)"
    assert "0.5" not in text


def test_wrong_answers_are_not_retried_and_no_retries_means_one_round():
    em = FakeEM({}, wins=())
    fig, _ = played(em)
    assert fig["complete"] and fig["success"] == 0.0 and len(em.ids) == 4 and fig["retried"] == 0
    em = FakeEM({1: 1})
    fig, _ = played(em, retries=0)
    assert not fig["complete"] and len(em.ids) == 4 and fig["failed_calls"] == 1


def test_a_cancelled_trajectory_is_not_retried_and_a_cancelled_evaluation_raises():
    em = FakeEM({1: None}, error=TrajectoryCancelled("eval-t-lake-1"))
    fig, _ = played(em)
    assert len(em.ids) == 4 and not fig["complete"] and fig["failures"] == {"TrajectoryCancelled: eval-t-lake-1": 1}

    class Hanging(FakeEM):
        async def run(self, traj, task, eval_temperature=None):
            await asyncio.sleep(60)

    async def cancel_it():
        t = asyncio.ensure_future(play(Hanging({}), Task(), range(3), "t", retries=2))
        await asyncio.sleep(0.05)
        t.cancel()
        await t

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_it())


def test_every_play_of_an_evaluation_is_an_evaluation_at_its_temperature_greedy_unless_given():
    """None would make em.run play a counted training rollout at the engine's temperature."""
    em = FakeEM({1: 1})
    played(em)
    assert em.temperatures == [0.0] * 5  # 4 seeds, then seed 1 again
    em = FakeEM({})
    asyncio.run(play(em, Task(), range(3), "t", 0.7))
    assert em.temperatures == [0.7] * 3
    assert played_as(0.0) == "greedy" and played_as(None) == "greedy" and played_as(0.7) == "sampled at T=0.7"


def test_old_rows_without_complete_read_by_their_failed_calls():
    assert is_complete({"success": 0.25, "failed_calls": 0}) and is_complete({"success": 0.25})
    old = {"success": 0.2, "failed_calls": 3, "seeds": 10}
    assert not is_complete(old) and shown(old) == "incomplete: 3 of 10 eval calls failed (reason not recorded)"
    assert (
        incomplete_note({"failed_calls": 3, "seeds": 9, "failures": {"A: x": 2, "B: y": 1}})
        == "incomplete: 3 of 9 eval calls failed (A: x ×2; B: y ×1)"
    )
    assert summarise({}, 0, 0.0)["complete"]  # no seeds: nothing failed


def test_trackers_log_the_failed_count_of_an_incomplete_evaluation_not_its_success():
    from rollart_dask.trackers import scalars

    bad = summarise({1: {"success": 1.0, "reward": 1.0}}, 4, 1.0, {"TimeoutError: x": 3})
    good = summarise({1: {"success": 1.0, "reward": 1.0}}, 1, 1.0)
    values = scalars({"kind": "eval", "step": 0, "version": 0, "eval": {"bad": bad, "good": good}})
    assert "eval/bad/success" not in values and "eval/bad/reward_mean" not in values
    assert values["eval/bad/failed_calls"] == 3 and values["eval/bad/complete"] == 0 and values["eval/bad/completed"] == 1
    assert values["eval/good/success"] == 1.0 and values["eval/good/complete"] == 1
    assert not any("failures" in k for k in values)  # free text never becomes a series name
    assert loggable(good) == {k: v for k, v in good.items() if k not in ("failures", "retried_for")}


def test_prometheus_and_the_page_leave_an_incomplete_evaluation_out():
    from rollart_dask.serve.dashboard.panels import panel_data
    from rollart_dask.serve.dashboard.plugin import RunState
    from rollart_dask.serve.dashboard.prometheus import RollartCollector

    state = RunState()
    state.merge(
        {
            "name": "f",
            "status": "running",
            "evals": [
                {"version": 0, "t": 1.0, "success": {"good": 0.5}, "failed": {"bad": 3}},
                {"version": 1, "t": 2.0, "success": {"good": 0.75, "bad": 0.0}, "failed": {"bad": 4}},
            ],
        }
    )
    c = RollartCollector()
    c.sources.append({"r1": state})
    fams = {f.name: f for f in c.collect()}
    success = {s.labels["task"]: s.value for s in fams["rollart_held_out_success"].samples}
    failed = {s.labels["task"]: s.value for s in fams["rollart_held_out_failed_calls"].samples}
    assert success == {"good": 0.75} and failed == {"bad": 4}
    data = panel_data(state)
    assert "bad" not in json.dumps(data["scores"]) and "good" in json.dumps(data["scores"])


def test_the_dashboard_snapshot_gives_an_incomplete_evaluation_failed_calls_not_a_success():
    from rollart_dask.control.snapshot import build_snapshot
    from tests.test_dashboard_on_cpu import fake_run

    run = fake_run()
    run.history[-1]["eval"]["sokoban"] = summarise({1: {"success": 1.0, "reward": 1.0}}, 4, 1.0, {"TimeoutError: x": 3})
    last = build_snapshot(run, now=145.0)["evals"][-1]
    assert last["success"] == {"frozenlake": 0.5} and last["failed"] == {"sokoban": 3}


def _write_run(path, last_complete: bool):
    path.mkdir(parents=True)
    ok = summarise({s: {"success": float(s % 2), "reward": float(s % 2)} for s in range(4)}, 4, 1.0)
    bad = summarise({0: {"success": 1.0, "reward": 1.0}}, 4, 1.0, {"TimeoutError: generate gave no answer in 60s": 3}, 3)
    rows = [
        {"time": 1.0, "kind": "eval", "step": 0, "version": 0, "elapsed_s": 1.0, "eval": {"frozenlake": ok}},
        {"time": 2.0, "kind": "step", "step": 1, "version": 1, "elapsed_s": 2.0, "reward_mean": 0.1, "success": 0.1},
        {"time": 3.0, "kind": "eval", "step": 1, "version": 1, "elapsed_s": 3.0, "eval": {"frozenlake": ok if last_complete else bad}},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "flow.yaml").write_text("name: quick\nrollout: {mode: rollart, alpha: 1}\ntrainer: {steps: 1}\n")


def test_report_and_rollart_runs_mark_an_incomplete_evaluation(tmp_path, monkeypatch):
    from rollart_dask.entry.cli import main
    from rollart_dask.entry.cli_runs import run_row
    from rollart_dask.tools.report import build_report
    from rollart_dask.tools.report.figures import heldout
    from rollart_dask.tools.report.runs import load_runs

    _write_run(tmp_path / "bad", last_complete=False)
    page = build_report([tmp_path / "bad"]).read_text()
    assert "frozenlake incomplete: 3 of 4 eval calls failed (TimeoutError: generate gave no answer in 60s)" in page
    assert "frozenlake 1.00" not in page  # its one completed seed's success is no score
    fig = heldout(load_runs([tmp_path / "bad"]))
    by_time = fig.axes[0]
    assert [len(line.get_xdata()) for line in by_time.lines if line.get_linestyle() != ":"] == [1]  # the complete point only
    assert any("incomplete evaluation" in t.get_text() for t in by_time.get_legend().get_texts())

    row = run_row(tmp_path / "bad")
    assert row["held_out"] == {"frozenlake": None} and "incomplete: 3 of 4" in row["held_out_incomplete"]["frozenlake"]
    from rollart_dask.observe import console

    monkeypatch.setattr(console, "width", 300)  # (a table cell folded over lines would split the text)
    res = CliRunner().invoke(main, ["runs", str(tmp_path)], catch_exceptions=False)
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "frozenlake incomplete: 3 of 4 eval calls failed" in text and "frozenlake 1.00" not in text, res.output

    _write_run(tmp_path / "good", last_complete=True)
    assert run_row(tmp_path / "good")["held_out"] == {"frozenlake": 0.5}
    assert "frozenlake 0.50 [" in build_report([tmp_path / "good"]).read_text()


def test_rollart_eval_shows_why_instead_of_an_incomplete_figure_and_builds_no_difference_on_it(tmp_path, monkeypatch):
    from rollart_dask.entry import evaluate
    from rollart_dask.entry.cli import main
    from rollart_dask.observe import console

    outcomes = {s: {"success": 1.0, "reward": 1.0} for s in range(3)}
    figs = {"a": summarise(outcomes, 3, 1.0), "b": summarise(dict(list(outcomes.items())[:1]), 3, 1.0, {"TimeoutError: slow": 2}, 2)}

    def fake(path, out, tasks, seeds, start, temperature, overrides):  # (what evaluate_sync returns, without a cluster)
        name = Path(path).name
        return {
            "checkpoint": str(Path(path) / "step-1"),
            "run": str(path),
            "version": 1,
            "start_seed": 0,
            "held_out": True,
            "temperature": 0.0,
            "eval": {"lake": figs[name]},
            "outcomes": {"lake": outcomes if name == "a" else {0: outcomes[0]}},
        }

    monkeypatch.setattr(evaluate, "evaluate_sync", fake)
    monkeypatch.setattr(console, "width", 400)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    res = CliRunner().invoke(
        main, ["eval", str(tmp_path / "a"), "--compare", str(tmp_path / "b"), "--out", str(tmp_path / "ev")], catch_exceptions=False
    )
    assert res.exit_code == 1, res.output  # an incomplete evaluation is no score, for a script reading the status either
    text = " ".join(res.output.split())
    assert "incomplete: 2 of 3 eval calls failed (TimeoutError: slow)" in text and "— (an evaluation is incomplete)" in text, res.output
    assert "Error: the evaluation of lake is incomplete: no score" in text
    cells = [" ".join(c.split()) for ln in res.output.splitlines() if ln.count("│") > 2 for c in ln.split("│")]
    assert "incomplete: 2 of 3 eval calls failed (TimeoutError: slow)" in cells  # in place of its success
    assert "1.00 [0.44, 1.00]" in cells and "1.00 [0.21, 1.00]" not in text  # the complete one keeps its figure; never the other's
    written = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert written["compare"]["lake"]["complete"] is False
