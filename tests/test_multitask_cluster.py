"""Multi-task flows on the shared local cluster: per-task group sizes, turn/token budgets and env
slots, per-task metrics and held-out scores, and labelled env failure injection."""

import json

from rollart_dask.entry.api import run_flow
from rollart_dask.config import load_flow
from tests.conftest import close, flow_dict, start_run

MATH = {
    "name": "math",
    "env": "math",
    "reward": "math",
    "affinity": "decode",
    "max_turns": 1,
    "max_tokens": 4,
    "group_size": 2,
    "env_args": {
        "dataset": "basic_arithmetic",
        "choices": [-10, 20],
        "dataset_args": {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 1,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
    },
}
SOKOBAN = {
    "name": "sokoban",
    "env": "sokoban",
    "reward": "sokoban",
    "affinity": "prefill",
    "max_turns": 6,
    "max_tokens": 2,
    "env_concurrency": 1,
}
FROZENLAKE = {
    "name": "frozenlake",
    "env": "frozenlake",
    "reward": "frozenlake",
    "affinity": "prefill",
    "max_turns": 6,
    "max_tokens": 2,
    "token_budget": 3,
    "group_size": 4,
}


def test_multitask_flow_reports_per_task_and_honours_per_task_settings(address, tmp_path, model_dir, run_async):
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "tasks": [FROZENLAKE, SOKOBAN, MATH],
                "rollout.batch_groups": 6,
                "rollout.group_size": 3,
                "trainer.steps": 3,
            }
        )
    )

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            result = await run.run()
            return result, run.metrics.rows, dict(run.services.em.envs_peak)
        finally:
            await close(run, client, cluster)

    result, rows, peak = run_async(go())
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 3
    sizes = {"frozenlake": 4, "sokoban": 3, "math": 2}  # per-task group_size, else rollout.group_size
    seen = set()
    for r in steps:
        for name, t in r["tasks"].items():
            seen.add(name)
            assert t["trajectories"] == t["groups"] * sizes[name]
            assert 0.0 <= t["success"] <= 1.0
        assert sum(t["groups"] for t in r["tasks"].values()) == 6
    assert len(seen) >= 2
    if "frozenlake" in seen:  # a token budget of 3 one-token actions ends a trajectory after 3 turns
        assert all(r["tasks"]["frozenlake"]["turns_per_traj"] <= 3 for r in steps if "frozenlake" in r["tasks"])
    if "math" in seen:
        assert all(r["tasks"]["math"]["turns_per_traj"] == 1 for r in steps if "math" in r["tasks"])
    assert peak.get("sokoban", 0) == 1  # env_concurrency 1 per env worker; demand was higher
    assert peak.get("frozenlake", 0) > 1  # no limit
    for ev in (result["first"], result["last"]):  # held-out scores per task, first and last
        assert set(ev["eval"]) == {"frozenlake", "sokoban", "math"}
        assert all(e["failed_calls"] == 0 for e in ev["eval"].values())


def test_injected_env_failures_are_retried_relaunched_counted_and_labelled(address, tmp_path, model_dir, run_async):
    inject = {
        "seed": 3,
        "reset_fail": 0.3,
        "step_fail": 0.05,
        "reset_latency": {"dist": "lognormal", "median_s": 0.01, "sigma": 1.0, "cap_s": 0.1},
    }
    task = dict(FROZENLAKE, token_budget=None, inject=inject)
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address, "tasks": [task], "trainer.steps": 2, "rollout.retries": 1}))
    result = run_async(run_flow(cfg, tmp_path))
    counts = result["counts"]
    assert result["steps"] == 2
    assert counts.get("env-reset_errors", 0) > 0  # injected reset failures were retried
    assert counts.get("failed", 0) > 0 and counts.get("relaunched", 0) >= counts["failed"]  # lost trajectories were relaunched, counted
    effective = (tmp_path / "flow.yaml").read_text()
    assert "reset_fail: 0.3" in effective and "emulated:" in effective and "env latency/failure injection" in effective
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["kind"] in ("step", "eval")


def test_warm_start_runs_before_the_first_held_out_evaluation(address, tmp_path, model_dir, run_async):
    """Expert demonstrations are played on the env workers and imitated on the trainer; the
    result is version 1, and the first held-out evaluation measures it (not the random init)."""
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "tasks": [FROZENLAKE, MATH],
                "trainer.steps": 2,
                "warmstart": {"steps": 30, "episodes": 20, "batch": 32, "tasks": {"frozenlake": 1, "math": 1}},
            }
        )
    )
    result = run_async(run_flow(cfg, tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r["kind"] == "warmstart"]
    assert len(warm) == 1 and warm[0]["steps"] == 30 and warm[0]["version"] == 1
    assert warm[0]["turns_per_task"]["math"] == 20 and warm[0]["turns_per_task"]["frozenlake"] >= 20  # one turn per math episode
    assert warm[0]["nll_last"] < warm[0]["nll_first"]
    assert rows.index(warm[0]) < min(i for i, r in enumerate(rows) if r["kind"] == "eval")
    assert result["first"]["version"] == 1 and result["steps"] == 2 and result["last"]["version"] == 3
    assert "warmstart:" in (tmp_path / "flow.yaml").read_text()
