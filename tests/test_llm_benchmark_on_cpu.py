"""benchmarks/llm_vs_single_process.py, its single-process arm (c) alone for two steps of flows/llm_math.yaml (SmolLM2 with
a LoRA adapter): the command ends well, results.json holds the arm's step times and held-out curve at the flow's
cadence, and the adapter the engine generates with after training is the trainer's, changed from the one it started with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_single_process_arm_trains_and_evaluates(tmp_path):
    from rollart_dask.models.prepare import cache_dir
    from rollart_dask.models.smollm2 import ModelUnavailable, build_smollm2

    try:
        build_smollm2(cache_dir() / "models")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "benchmarks/llm_vs_single_process.py",
        "--arms",
        "c",
        "--rounds",
        "1",
        "--minutes",
        "30",
        "--target",
        "1.0",
        "--out",
        str(out),
    ]
    for s in ("trainer.steps=2", "eval.every=1", "eval.seeds=4", "rollout.group_size=2", "rollout.batch_groups=2"):
        cmd += ["--set", s]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=560)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + (out / "r1-c.log").read_text()[-3000:]
    assert "seconds per step" in res.stdout and "held-out math success" in res.stdout and "time to held-out" in res.stdout

    results = json.loads((out / "results.json").read_text())
    assert results["target"] == 1.0 and results["target_rule"] == "given" and list(results["arms"]) == ["c"]
    (run,) = results["runs"]
    assert run["arm"] == "c" and run["rc"] == 0 and run["round"] == 1
    assert run["startup_s"] >= 0 and run["first_eval_s"] > 0
    st = run["step_times"]
    assert st["steps"] == 2 and st["step_s"] > 0 and st["gen_s"] > 0 and st["train_s"] > 0 and st["swap_s"] >= 0
    assert st["wait_batch_s"] is None and st["wait_train_s"] is None  # nothing waits in one sequential process
    curve = run["curve"]
    assert [p["version"] for p in curve] == [0, 1, 2]  # eval.every=1: v0, then after each step
    assert all(p["complete"] and p["failed_calls"] == 0 and p["seeds"] == 4 and 0.0 <= p["score"] <= 1.0 for p in curve)
    assert [p["elapsed_s"] for p in curve] == sorted(p["elapsed_s"] for p in curve)

    rows = [json.loads(line) for line in (out / "r1-c" / "metrics.jsonl").open()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["version"] for r in steps] == [1, 2]
    for r in steps:
        assert r["trajectories"] == 4 and r["samples"] == 4  # 2 groups × 2 members, one turn each
        assert {"gen_s", "env_s", "reward_s", "train_s", "swap_s", "step_s", "elapsed_s", "loss", "grad_norm"} <= set(r)

    summary = json.loads((out / "r1-c" / "summary.json").read_text())
    w = summary["weights"]
    assert w["lora"] and w["tensors"] > 0
    assert w["changed"] and w["max_abs_change"] > 0  # the engine's adapter moved from its start (B = 0)
    assert w["engine_equals_trainer"] and w["engine_version"] == w["trainer_version"] == 2  # and is the trainer's, swapped in
