"""Held-out evaluation of a real run whose eval calls fail (shared local cluster): an env whose reset raises for some
held-out seeds. A seed that fails the first time only is played again and the evaluation completes; a seed that
always fails leaves it incomplete, written with its reason, and `rollart run`, `rollart runs` and the report say so
instead of a score."""

import html
import json
import os
from pathlib import Path

import yaml
from click.testing import CliRunner

from rollart_dask.envs.frozenlake import FrozenLakeText
from tests.conftest import flow_dict

HELD_OUT = 1_000_000


class FlakyLake(FrozenLakeText):
    """FrozenLake whose reset raises for the seeds marked in ``marks`` (a folder every worker sees): ``once-SEED`` the
    first time (the mark is taken), ``always-SEED`` every time."""

    def __init__(self, marks: str, **kw):
        super().__init__(**kw)
        self.marks = Path(marks)

    def reset(self, seed: int):
        if (self.marks / f"always-{seed}").exists():
            raise RuntimeError("flaky env: broken seed")
        try:
            os.remove(self.marks / f"once-{seed}")
        except FileNotFoundError:
            return super().reset(seed)
        raise RuntimeError("flaky env: first reset fails")


def task(name: str, marks: Path) -> dict:
    return {
        "name": name,
        "env": f"{__name__}:FlakyLake",
        "env_args": {"marks": str(marks), "size": 4},
        "reward": "frozenlake",
        "affinity": "prefill",
        "max_turns": 4,
        "max_tokens": 2,
    }


def test_failed_eval_calls_are_retried_and_an_evaluation_still_failing_is_reported_incomplete_not_scored(address, tmp_path, monkeypatch):
    from rollart_dask.entry.cli import main
    from rollart_dask.observe import console
    from rollart_dask.tools.report import build_report

    once, always = tmp_path / "once", tmp_path / "always"
    for d in (once, always):
        d.mkdir()
    for s in (HELD_OUT, HELD_OUT + 2):
        (once / f"once-{s}").touch()
    (always / f"always-{HELD_OUT + 1}").touch()
    # rollout.retries 0: the env manager's own reset retry would hide the first failure from the evaluation
    data = flow_dict(
        **{
            "tasks": [task("steady", once), task("broken", always)],
            "rollout.retries": 0,
            "trainer.steps": 1,
            "eval.seeds": 4,
            "eval.retries": 2,
        }
    )
    (tmp_path / "flow.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    monkeypatch.setattr(console, "width", 400)  # (a table cell folded over lines would split the text)
    res = CliRunner().invoke(main, ["run", str(tmp_path / "flow.yaml"), "--scheduler", address, "--out", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert not list(once.iterdir())  # both marks taken: those seeds failed once

    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in line]
    assert [e["version"] for e in evals] == [0, 1]
    steady0, steady1 = (e["eval"]["steady"] for e in evals)
    assert steady0["complete"] and steady0["retried"] == 2 and steady0["completed"] == 4 and steady0["failures"] == {}
    assert steady1["complete"] and steady1["retried"] == 0
    reason = "UserCodeFailed: task 'broken': reset failed: FlakyLake.reset raised RuntimeError: flaky env: broken seed"
    for e in evals:
        broken = e["eval"]["broken"]
        assert not broken["complete"] and broken["completed"] == 3 and broken["failed_calls"] == 1 and broken["seeds"] == 4
        assert broken["failures"] == {reason: 1} and broken["retried"] == 1

    text = " ".join(res.output.split())
    note = f"incomplete: 1 of 4 eval calls failed ({reason})"
    row = {ln.split("│")[1].strip(): " ".join(ln.split("│")[2].split()) for ln in res.output.splitlines() if "held-out" in ln and "│" in ln}
    assert row["held-out broken success (greedy)"] == f"{note} (v0) → {note} (v1)", res.output  # no score, no Δ built on it
    assert row["held-out steady success (greedy)"].startswith(f"{steady0['success']:.3f} (v0) → {steady1['success']:.3f} (v1) Δ "), (
        res.output
    )
    assert f"broken={note}" in text  # the per-evaluation line

    res = CliRunner().invoke(main, ["runs", str(tmp_path)], catch_exceptions=False)
    listed = " ".join(res.output.split())
    assert res.exit_code == 0 and f"broken {note}" in listed and f"steady {steady1['success']:.2f}" in listed, res.output
    res = CliRunner().invoke(main, ["eval", str(out), "--task", "broken", "--out", str(tmp_path / "ev")], catch_exceptions=False)
    assert res.exit_code == 1 and "the evaluation of broken is incomplete: no score" in res.output, res.output
    [mine] = json.loads((tmp_path / "ev" / "eval.json").read_text())["results"]
    assert mine["version"] == 1 and not mine["eval"]["broken"]["complete"] and mine["eval"]["broken"]["failures"] == {reason: 1}
    cells = [" ".join(c.split()) for ln in res.output.splitlines() if ln.count("│") > 2 for c in ln.split("│")]
    assert note in cells and f"broken: {note}" in " ".join(res.output.split()), res.output  # in place of its success, and why
    page = build_report([out]).read_text()
    assert html.escape(f"broken {note}") in page and "class=incomplete" in page
