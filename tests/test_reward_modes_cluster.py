"""reward.mode on the shared local cluster: serverless rewards go through boto3 to a local
Lambda-compatible endpoint started for the run; a reward that fails is never made up."""

from rollart_dask.config import load_flow
from rollart_dask.control.reward_plane import function_name
from tests.conftest import close, flow_dict, start_run
from tests.test_multitask_cluster import FROZENLAKE, MATH


def test_serverless_rewards_through_the_lambda_api_and_failures_are_counted_not_scored(address, tmp_path, model_dir, run_async):
    # 'broken' scores FrozenLake trajectories with the math reward, whose handler raises on them
    broken = dict(FROZENLAKE, name="broken", reward="math", weight=0.5, token_budget=None)
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "tasks": [dict(FROZENLAKE, token_budget=None), MATH, broken],
                "reward": {"mode": "serverless", "keep_warm_s": 30},
                "rollout.batch_groups": 3,
                "rollout.retries": 0,
                "rollout.max_relaunch": 2,
                "trainer.steps": 3,
                "rollout.user_faults": {"consecutive": 0},  # counted, never stopping the run
                "rollout.preflight": False,
            }
        )
    )  # (which would refuse the broken task before it starts)

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            assert run.services.rewards.url.startswith("http://127.0.0.1:")
            result = await run.run()
            return result, run.metrics.rows, dict(run.services.rewards.functions), list(run.trained_ids), run.services.em.counts
        finally:
            await close(run, client, cluster)

    result, rows, functions, trained, em_counts = run_async(go())
    assert functions == {"frozenlake": function_name("rollart-reward-", "frozenlake"), "math": "rollart-reward-math"}
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 3 and all(r["reward"]["mode"] == "serverless" for r in steps)
    total = {k: sum(r["reward"].get(k, 0) for r in steps) for k in ("calls", "cold_starts", "errors", "billed_s")}
    assert total["calls"] > 0 and total["cold_starts"] >= 1 and total["billed_s"] > 0
    assert any(0 < r["reward"]["utilisation"] <= 1 for r in steps)
    # on-demand billing: what was paid for is the invocations (handler + cold-start init), mostly spent scoring
    assert all(0 <= r["reward"]["paid_utilisation"] <= 1 for r in steps) and any(r["reward"]["paid_utilisation"] > 0 for r in steps)
    # the broken task's rewards failed: counted as failed trajectories, never trained on
    assert total["errors"] > 0 and em_counts["reward_errors"] > 0 and result["counts"].get("failed", 0) > 0
    assert result["last"]["eval"]["broken"]["failed_calls"] == result["last"]["eval"]["broken"]["seeds"]
    assert result["last"]["eval"]["frozenlake"]["failed_calls"] == 0 and result["last"]["eval"]["math"]["failed_calls"] == 0
    broken_groups = {r.get("tasks", {}).get("broken", {}).get("groups", 0) for r in steps}
    assert broken_groups == {0}
    assert len(trained) == sum(t["trajectories"] for r in steps for t in r["tasks"].values())
