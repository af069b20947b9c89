"""The CLI end to end, as a user runs it: embedded cluster, tiny budgets."""

import json
import subprocess
import sys

import pytest
import torch
import yaml

RUN = [sys.executable, "-m", "rollart_dask.entry.cli", "run", "flows/quickstart.yaml"]
TINY = ["--set", "rollout.batch_groups=4", "--set", "eval.seeds=10", "--set", "eval.every=2", "--set", "observe.progress=false"]


def test_rollart_run_writes_metrics_config_and_checkpoint(tmp_path):
    """Also every tracker (observe.loggers): a real run's W&B (offline) and MLflow (file store) runs hold metrics.jsonl's
    rows, the effective flow and the final checkpoint."""
    from test_trackers_on_cpu import isolated_env, read_mlflow, read_wandb, triples_of_jsonl

    out = tmp_path / "run"
    res = subprocess.run(
        [*RUN, "--out", str(out), "--set", "trainer.steps=3", "--set", "observe.loggers=[tensorboard,wandb,mlflow]", *TINY],
        capture_output=True,
        text=True,
        timeout=400,
        env=isolated_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "held-out frozenlake success" in res.stderr and "quickstart — summary" in res.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in rows if r["kind"] == "step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in evals] == [0, 2, 3]
    for key in ("get_batch_s", "train_s", "staleness", "pool_busy", "tokens_per_s", "reward_mean", "entropy", "buffer", "stage_latency"):
        assert key in steps[-1], key
    assert "update_s" in steps[-1] and "suspend_s" in steps[-1] and "recompute_kv_s" in steps[-1]
    eff = yaml.safe_load((out / "flow.yaml").read_text())
    assert eff["_effective"]["engine_backend"] == "torch" and eff["_effective"]["engines"] == {"H800": ["h800-0"]}
    assert eff["rollout"]["batch_groups"] == 4  # overrides land in the effective config
    ckpt = (out / "checkpoints" / "latest").read_text().strip()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt)
    initial = load_file(f"{eff['_effective']['model_dir']}/model.safetensors")  # the model the run started from
    v3 = load_file(f"{ckpt}/model.safetensors")
    assert v3.keys() == initial.keys() and [k for k in initial if not torch.equal(v3[k], initial[k])]  # trained weights were saved
    assert (out / "tensorboard").is_dir()
    expected, final = triples_of_jsonl(out / "metrics.jsonl"), {p.name for p in __import__("pathlib").Path(ckpt).iterdir()}
    w_triples, w_config, w_artifacts = read_wandb(out)
    assert w_triples == expected and len(expected) > 100
    assert w_config["rollout"]["batch_groups"] == 4 and w_config["observe"]["loggers"] == ["tensorboard", "wandb", "mlflow"]
    assert {f.split("/")[-1] for f in w_artifacts["quickstart-checkpoint"][1]} >= final > {"model.safetensors"}
    m_triples, params, _, m_ckpt, m_flow, status = read_mlflow(out)
    assert m_triples == expected and params["rollout/batch_groups"] == "4" and status == "FINISHED"
    assert {f.split("/")[-1] for f in m_ckpt} >= final and m_flow["_effective"]["engine_backend"] == "torch"

    # --resume continues from the checkpoint's version, and from its weights
    res = subprocess.run(
        [*RUN, "--out", str(out), "--resume", "--set", "trainer.steps=1", *TINY], capture_output=True, text=True, timeout=400
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert rows[-1]["kind"] == "eval" and rows[-1]["version"] == 4
    v4 = load_file(f"{(out / 'checkpoints' / 'latest').read_text().strip()}/model.safetensors")
    # one step on top of v3's weights, not one step from the initial weights (three steps away)
    from_v3, from_initial = distance(v4, v3), distance(v4, initial)
    assert from_v3 < from_initial, (from_v3, from_initial)

    # the report of this run, resumed: one page, every figure its rows have (an EMULATED-free torch run has them all)
    res = subprocess.run([*RUN[:-2], "report", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    page = (out / "report" / "index.html").read_text()
    assert "not drawn" not in page and "4 of 1" not in page and "<td>4</td>" in page
    from rollart_dask.tools.report.figures import FIGURES

    assert all((out / "report" / name).stat().st_size > 5_000 for name, _, _ in FIGURES)


def distance(a: dict, b: dict) -> float:
    return sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5


@pytest.mark.slow
def test_quickstart_learns_a_little(tmp_path):
    """A short quickstart: the training reward must rise (the full held-out target is a README measurement)."""
    out = tmp_path / "learn"
    res = subprocess.run(
        [
            *RUN,
            "--out",
            str(out),
            "--set",
            "trainer.steps=40",
            "--set",
            "eval.seeds=20",
            "--set",
            "eval.every=0",
            "--set",
            "observe.progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    steps = [r for r in steps if r["kind"] == "step"]
    first = sum(r["reward_mean"] for r in steps[:5]) / 5
    last = sum(r["reward_mean"] for r in steps[-5:]) / 5
    assert last > first + 0.08, (first, last)


@pytest.mark.slow
def test_benchmark_runs_both_modes(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/sync_vs_rollart.py",
            "--minutes",
            "0.3",
            "--target",
            "0.0",
            "--out",
            str(tmp_path),
            "--set",
            "eval.seeds=10",
            "--set",
            "rollout.batch_groups=4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"sync", "rollart α=1"}
    assert all(r["steps"] >= 1 for r in results.values())


@pytest.mark.slow
def test_staleness_grid_runs_a_cell_and_its_restart_twin(tmp_path):
    """benchmarks/staleness_grid.py at a tiny budget: eager α=4 with tis, continued and restarted, each with its tokens."""
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/staleness_grid.py",
            "--alpha",
            "4",
            "--correction",
            "tis",
            "--minutes",
            "0.3",
            "--out",
            str(tmp_path),
            "--set",
            "eval.seeds=10",
            "--set",
            "rollout.batch_groups=4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"α=4 tis continue", "α=4 tis restart"}
    for r in results.values():
        assert r["steps"] >= 1 and r["tokens"]["generated"] >= r["tokens"]["trained"] > 0
    assert results["α=4 tis restart"]["tokens"]["continued"] == 0 and results["α=4 tis continue"]["tokens"]["discarded"] == 0
    assert (tmp_path / "heldout.png").stat().st_size > 0


@pytest.mark.slow  # (40-50 s: the default stage's budget is 15 minutes)
def test_scale_benchmark_measures_a_shape_beside_its_simulated_policy(tmp_path):
    """benchmarks/scale.py at a tiny budget: the paper's cluster shape (128 EMULATED GPUs) with a 4-group batch, its
    CPU workers sized to what it holds in flight, measured beside its simulated policy and ideal."""
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/scale.py",
            "--shape",
            "paper",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--time-scale",
            "0.01",
            "--out",
            str(tmp_path),
            "--set",
            "rollout.batch_groups=40",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    [r] = json.loads((tmp_path / "results.json").read_text())
    assert r["shape"] == "paper" and r["in_flight_max"] == 640 and r["cpu_workers"] == 2  # 640 envs: two hosts of 512 threads
    assert r["measured"]["step_s"] > 0 and r["simulated"]["step_s"] > 0 and r["ideal"]["step_s"] > 0
    assert set(r["overhead_share"]) >= {"generate", "env-step"} and 0 < r["client_cpu_share"]


def _trained(tmp_path):
    """A 2-step quickstart run, checkpointed at each step: (its OUT, its last held-out evaluation row)."""
    out = tmp_path / "run"
    res = subprocess.run(
        [*RUN, "--out", str(out), "--set", "trainer.steps=2", "--set", "trainer.checkpoint_every=1", *TINY],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint:  {(out / 'checkpoints' / 'step-2').resolve()}\n" in res.stderr  # whole, on one line, to copy
    return out, [json.loads(line) for line in (out / "metrics.jsonl").open() if '"kind": "eval"' in line][-1]


EVAL = [sys.executable, "-m", "rollart_dask.entry.cli", "eval"]
WIDE = {**__import__("os").environ, "COLUMNS": "300"}


@pytest.mark.slow  # (40-50 s: the default stage's budget is 15 minutes)
def test_rollart_eval_agrees_with_the_runs_held_out_figure_and_rollart_runs_lists_the_run(tmp_path):
    """`rollart eval RUN_DIR` replays the run's last held-out evaluation (same seeds, same weights, greedy) through its own
    engine/env/reward path."""
    out, last = _trained(tmp_path)
    res = subprocess.run([*EVAL, str(out), "--out", str(tmp_path / "ev")], capture_output=True, text=True, timeout=400, env=WIDE)
    assert res.returncode == 0, res.stderr[-3000:]
    [mine] = json.loads((tmp_path / "ev" / "eval.json").read_text())["results"]
    fig, theirs = mine["eval"]["frozenlake"], last["eval"]["frozenlake"]
    assert mine["version"] == last["version"] == 2 and mine["held_out"] and fig["seeds"] == theirs["seeds"] == 10
    lo, hi = fig["success_ci"]
    assert lo <= theirs["success"] <= hi and lo < hi, (fig, theirs)  # the run's own figure lies within this one's interval
    assert "success step-2 (v2) [95% CI]" in res.stderr and "held-out range" in res.stderr

    res = subprocess.run(
        [sys.executable, "-m", "rollart_dask.entry.cli", "runs", str(tmp_path)], capture_output=True, text=True, timeout=120, env=WIDE
    )
    listed = [line for line in res.stderr.splitlines() if str(out) + " " in line]
    assert res.returncode == 0 and len(listed) == 1 and "2 (2)" in listed[0], res.stderr
    assert f"frozenlake {theirs['success']:.2f} @v2" in listed[0] and res.stderr.count("evaluation only") == 1, res.stderr

    res = subprocess.run([*EVAL, str(out), "--task", "sokoban"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "--task sokoban: no such task in the run's flow; its tasks: frozenlake" in res.stderr


@pytest.mark.slow
def test_rollart_eval_compares_two_checkpoints_seed_by_seed_on_an_unseen_range(tmp_path):
    out, _ = _trained(tmp_path)
    unseen = ["--start", "5000", "--seeds", "6"]
    res = subprocess.run(
        [
            *EVAL,
            str(out / "checkpoints" / "step-2"),
            "--compare",
            str(out / "checkpoints" / "step-1"),
            *unseen,
            "--out",
            str(tmp_path / "cmp"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=WIDE,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    written = json.loads((tmp_path / "cmp" / "eval.json").read_text())
    a, b = written["results"]
    assert (a["version"], b["version"]) == (2, 1) and a["start_seed"] == b["start_seed"] == 5000 and not a["held_out"]
    assert sorted(map(int, a["outcomes"]["frozenlake"])) == list(range(5000, 5006)) == sorted(map(int, b["outcomes"]["frozenlake"]))
    d = written["compare"]["frozenlake"]["success"]
    assert d["seeds"] == 6 and d["ci"][0] <= d["diff"] <= d["ci"][1]
    assert d["diff"] == pytest.approx(a["eval"]["frozenlake"]["success"] - b["eval"]["frozenlake"]["success"])
    assert "success A − B" in res.stderr


def _descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _started(proc, out, timeout=300) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach its first metrics line"
        time.sleep(0.5)


@pytest.mark.slow
def test_sigterm_stops_a_run_cleanly_and_sigkill_leaves_no_scheduler(tmp_path):
    """`kill` (SIGTERM) stops a run as Ctrl-C does: it exits, says how to resume, and leaves no process of its embedded
    cluster. Even SIGKILL, which no handler sees, takes the embedded scheduler with it (it asked Linux to be told)."""
    import os
    import signal
    import time

    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / sig.name
        log = (tmp_path / f"{sig.name}.log").open("w")
        proc = subprocess.Popen(
            [*RUN, "--out", str(out), "--set", "trainer.steps=200", *TINY], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _started(proc, out)
            children = _descendants(proc.pid)
            scheduler = [p for p in children if "dask scheduler" in " ".join(p.cmdline()) or "spec" in p.cmdline()]  # (or its title)
            assert scheduler, [p.cmdline()[:4] for p in children]
            t0 = time.monotonic()
            os.kill(proc.pid, sig)
            rc = proc.wait(90)
            if sig == signal.SIGTERM:
                assert rc == 130 and time.monotonic() - t0 < 90, rc
                said = (tmp_path / f"{sig.name}.log").read_text()
                assert "stopped by SIGTERM" in said and "--resume" in said, said[-2000:]
                gone, alive = psutil.wait_procs(children, timeout=30)
            else:
                gone, alive = psutil.wait_procs(scheduler, timeout=30)
            assert not alive, [p.cmdline()[:5] for p in alive]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for p in _descendants(proc.pid) if proc.poll() is None else []:
                p.kill()
