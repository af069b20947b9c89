"""`rollart report` on run directories written here (rows shaped as a run writes them): the page, every figure that
has data, one line per run when comparing, the staleness shares, and errors that name what is wrong."""

import gzip
import json
import re

import pytest
from click.testing import CliRunner

from rollart_dask.entry.cli import main
from rollart_dask.tools.report import build_report, default_out
from rollart_dask.tools.report.figures import FIGURES, heldout, lag_totals, staleness_shares, train
from rollart_dask.tools.report.runs import ReportError, load_runs

T0 = 1_800_000_000.0


def step_row(n: int, success: float, stale: dict) -> dict:
    return {
        "time": T0 + 10 * n,
        "kind": "step",
        "step": n,
        "version": n,
        "reward_mean": success,
        "success": success,
        "tasks": {"frozenlake": {"success": success}},
        "staleness": stale,
        "lag_hist": {"in_flight": {"0": 6}, "in_queue": {"0": 2, "1": 2}},
        "reward": {
            "mode": "serverless",
            "calls": 8,
            "rewards": {"frozenlake": {"where": "SERVERLESS", "calls": 8, "latency_ms": 3.0}},
            "utilisation": 0.5,
            "cold_starts": 1 if n == 1 else 0,
            "throttles": 0,
            "errors": 0,
        },
        "pool_busy": {"CPU": 0.4, "H800": 0.7},
        "buffer": {"finished": 8 * n, "stale_dropped": n, "failed": 0, "groups_trained": 2 * n},
        "reissued": 0,
        "get_batch_s": 0.1,
        "suspend_s": 0.01,
        "update_s": 0.02,
        "recompute_kv_s": 0.0,
        "train_s": 0.5,
        "wait_train_s": 0.2,
        "weights": {"store": "dask", "bytes": 2**20, "publish_s": 0.01, "transfer_s": 0.02, "waited_s": 0.0},
        "entropy": 1.3 - 0.01 * n,
        "approx_kl": 0.001,
        "clip_frac": 0.05,
    }


def eval_row(version: int, success: float) -> dict:
    return {
        "time": T0 + 10 * version + 1,
        "kind": "eval",
        "step": version,
        "version": version,
        "elapsed_s": 2.0,
        "eval": {"frozenlake": {"success": success, "success_ci": [max(0, success - 0.2), min(1, success + 0.2)], "reward_mean": success}},
    }


def write_run(path, steps: int = 6, final: float = 0.75, mode: str = "rollart", cut_last: bool = False) -> None:
    path.mkdir(parents=True)
    rows = [eval_row(0, 0.0)]
    for n in range(1, steps + 1):
        rows.append(step_row(n, final * n / steps, {"0": 6, "1": 2} if n % 2 else {"0": 8}))
        if n % 3 == 0:
            rows.append(eval_row(n, final * n / steps))
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / "metrics.jsonl").write_text(text + ('{"time": 1, "kind": "st' if cut_last else ""))
    (path / "flow.yaml").write_text(f"name: quick\nrollout: {{mode: {mode}, alpha: 1}}\ntrainer: {{steps: {steps}}}\n")
    (path / "summary.json").write_text(json.dumps({"accounting": {"launched": 60, "trained": 48, "stale_dropped": 12}}))


def test_report_of_one_run_has_every_figure_and_its_summary(tmp_path):
    write_run(tmp_path / "run")
    index = build_report([tmp_path / "run"])
    assert index == tmp_path / "run" / "report" / "index.html"
    page = index.read_text()
    for name, heading, _ in FIGURES:  # every figure has data here: each is written and shown
        assert (index.parent / name).stat().st_size > 5_000, name
        assert f"src='{name}'" in page and heading in page
    assert "not drawn" not in page
    assert "frozenlake 0.75 [0.55, 0.95]" in page and "@v6" in page  # the last held-out evaluation with its interval
    assert "rollart α=1" in page and "6 of 6" in page and "60 launched: 48 trained, 12 stale dropped" in page


def test_comparing_runs_puts_one_line_per_run_and_writes_beside_them(tmp_path):
    write_run(tmp_path / "bench" / "sync", final=0.25, mode="sync")
    write_run(tmp_path / "bench" / "rollart", final=0.75)
    sync_rows = tmp_path / "bench" / "sync" / "metrics.jsonl"  # an archived run: its rows gzipped
    (sync_rows.parent / "metrics.jsonl.gz").write_bytes(gzip.compress(sync_rows.read_bytes()))
    sync_rows.unlink()
    runs = load_runs([tmp_path / "bench"])  # a folder stands for every run below it
    assert sorted(r.label for r in runs) == ["rollart", "sync"]
    assert default_out(runs) == (tmp_path / "bench" / "report").resolve()
    fig = heldout(runs)
    by_time = fig.axes[0]
    assert sorted(line.get_label() for line in by_time.lines) == ["rollart", "sync"]
    finals = {line.get_label(): line.get_ydata()[-1] for line in by_time.lines}
    assert finals == {"rollart": 0.75, "sync": 0.25}
    assert [round(x, 3) for x in next(line for line in by_time.lines if line.get_label() == "sync").get_xdata()] == [0.033, 0.533, 1.033]
    train_labels = {line.get_label() for ax in train(runs).axes for line in ax.lines if not line.get_label().startswith("_")}
    assert train_labels == {"rollart", "sync"}
    page = build_report([tmp_path / "bench"]).read_text()
    assert "2 runs compared" in page and page.count("<tr>") == 3


def test_staleness_shares_per_step():
    steps = [{"staleness": {"0": 6, "1": 2}}, {"staleness": {"0": 8}}, {}, {"staleness": {"2": 1, "0": 3}}]
    shares = staleness_shares(steps)
    assert shares == {0: [0.75, 1.0, 0.0, 0.75], 1: [0.25, 0.0, 0.0, 0.0], 2: [0.0, 0.0, 0.0, 0.25]}


def test_lag_totals_sum_each_part_over_the_run():
    steps = [
        {"lag_hist": {"in_flight": {"0": 6, "1": 2}, "in_queue": {"1": 8}}},
        {},
        {"lag_hist": {"in_flight": {"1": 1}, "in_queue": {"0": 1}}},
    ]
    assert lag_totals(steps) == {"in_flight": {0: 6, 1: 3}, "in_queue": {0: 1, 1: 8}}
    assert lag_totals([{}, {"staleness": {"0": 1}}]) == {}  # rows from before the split: no figure


def test_a_run_still_writing_is_reported_and_a_missing_figure_is_named(tmp_path):
    write_run(tmp_path / "run", cut_last=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in rows:
        r.pop("weights", None)  # a run whose rows carry no weight-transfer figures
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut')
    (tmp_path / "run" / "summary.json").unlink()
    page = build_report([tmp_path / "run"], out=tmp_path / "out").read_text()
    assert not (tmp_path / "out" / "weights.png").exists()
    assert re.search(r"not drawn \(no run recorded their figures\): Weight transfer", page)
    assert "the run has not finished" in page


def test_errors_name_the_directory_and_what_a_run_holds(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"empty: no metrics.jsonl in it or below it"):
        build_report([tmp_path / "empty"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"kind": "step"}\nnot json\n{"kind": "step"}\n')
    with pytest.raises(ReportError, match=r"bad/metrics.jsonl line 2: not JSON"):
        build_report([bad])
    result = CliRunner().invoke(main, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "missing: no such directory" in result.output
    write_run(tmp_path / "ok")
    result = CliRunner().invoke(main, ["report", str(tmp_path / "ok"), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0 and (tmp_path / "r" / "index.html").exists(), result.output
