"""The LLM-as-judge reward on a cluster: a stateful reward stays on the REWARD pool (with its judge
engine) while stateless rewards of the same run go through the Lambda API; a serverless caller
that is not a REWARD worker hands judge items on to one."""

import asyncio
import math

from rollart_dask.config import load_flow
from rollart_dask.control.reward_plane import function_name
from rollart_dask.data import plugins, tasks
from tests.conftest import close, flow_dict, start_run
from tests.test_multitask_cluster import FROZENLAKE, MATH

JUDGED_MATH = dict(MATH, name="math-judged", reward="judge", eval_seeds=2)


def _traj(action: str) -> dict:
    return {
        "task": "math",
        "seed": 0,
        "turns": [{"observation": "Calculate 3 + 5.", "action": action, "env_reward": 0.0}],
        "info": {"dataset": "basic_arithmetic", "entry": {"question": "Calculate 3 + 5.", "answer": "8", "metadata": {}}},
    }


def test_judge_stays_on_the_reward_worker_while_other_rewards_go_serverless(address, tmp_path, model_dir, run_async):
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "tasks": [dict(FROZENLAKE, token_budget=None), JUDGED_MATH],
                "reward": {"mode": "serverless", "keep_warm_s": 30},
                "rollout.batch_groups": 2,
                "trainer.steps": 2,
            }
        )
    )

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        judged = []
        train = run.train

        async def spy(groups, rec):  # the trajectories each training step consumed
            judged.extend(t for g in groups for t in g.kept if t.task == "math-judged")
            await train(groups, rec)

        run.train = spy
        endpoint_fns = set()

        def seen_by_endpoint(r):  # functions the Lambda endpoint has run (it stops with the run)
            endpoint_fns.update(r.services.rewards.endpoint.stats()["functions"])

        try:
            result = await run.run(on_step=seen_by_endpoint)
            stats = await client.run(tasks.service_stats)
            info = await client.scheduler.identity()
            return (
                result,
                run.metrics.rows,
                dict(run.services.rewards.functions),
                dict(run.services.rewards.where),
                stats,
                info,
                endpoint_fns,
                judged,
            )
        finally:
            await close(run, client, cluster)

    result, rows, functions, where, stats, info, endpoint_fns, judged = run_async(go())
    # the judge is not deployed and never invoked through the Lambda API; frozenlake is
    assert functions == {"frozenlake": function_name("rollart-reward-", "frozenlake")}
    assert endpoint_fns == {functions["frozenlake"]}
    assert where["judge"].startswith("REWARD") and where["frozenlake"].startswith("SERVERLESS")
    # the judge ran in the runner of the REWARD worker, with its engine
    reward_runners = {addr: s[plugins.REWARD] for addr, s in stats.items() if plugins.REWARD in s}
    on_reward_pool = {a: st for a, st in reward_runners.items() if "REWARD" in info["workers"][a]["resources"]}
    assert sum(st["judge_calls"] for st in on_reward_pool.values()) > 0
    assert sum(st["judge_calls"] for st in reward_runners.values()) == sum(st["judge_calls"] for st in on_reward_pool.values())
    assert all(st["judge_errors"] == 0 for st in reward_runners.values())
    # trajectories trained on carry the judge's verdict as their reward
    assert judged and all(t.info["reward"]["verdict"] in ("Yes", "No") for t in judged)
    assert all(math.isfinite(t.reward) and 0.0 <= t.reward <= 1.0 and t.reward == t.info["reward"]["score"] for t in judged)
    assert all((t.reward >= 0.5) == (t.info["reward"]["verdict"] == "Yes") for t in judged)
    # per-step reward metrics: where each reward ran, judge calls with their latency, the local worker's utilisation
    steps = [r for r in rows if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["reward"]["mode"] == "serverless" for r in steps)
    assert all(r["reward"]["rewards"]["judge"]["where"].startswith("REWARD") for r in steps)
    assert all(r["reward"]["rewards"]["frozenlake"]["where"].startswith("SERVERLESS") for r in steps)
    assert sum(r["reward"]["judge"]["calls"] for r in steps) > 0
    assert sum(r["reward"]["rewards"]["frozenlake"]["calls"] for r in steps) > 0
    step = next(r for r in steps if r["reward"]["judge"]["calls"])
    assert step["reward"]["judge"]["batch_ms"] > 0 and step["reward"]["rewards"]["judge"]["latency_ms"] > 0
    assert step["reward"]["local"]["workers"] >= 1 and 0 < step["reward"]["local"]["utilisation"] <= 1
    assert step["reward"]["calls"] >= step["reward"]["judge"]["calls"]  # judge calls count among the step's reward calls
    assert result["last"]["eval"]["math-judged"]["failed_calls"] == 0 and result["last"]["eval"]["frozenlake"]["failed_calls"] == 0


def test_judge_items_are_scored_on_the_reward_pool_in_both_modes(model_dir, run_async):
    """Separate SERVERLESS and REWARD workers, serverless mode: a runner is on each, and only the
    REWARD one hosts the judge; then in local mode one reward batch holds plain and judge items."""
    from distributed import Client, SpecCluster, Worker

    from rollart_dask.resource.pools import submit_kwargs, worker_resources

    async def go():
        workers = {
            name: {"cls": Worker, "options": {"nthreads": 1, "resources": worker_resources(pools), "name": name}}
            for name, pools in (("caller", ["SERVERLESS"]), ("judge-host", ["REWARD"]))
        }
        async with (
            SpecCluster(workers=workers, asynchronous=True, silence_logs=40) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            await client.wait_for_workers(2)
            names = {a: w["name"] for a, w in (await client.scheduler.identity())["workers"].items()}

            async def stats():
                return {names[a]: s[plugins.REWARD] for a, s in (await client.run(tasks.service_stats)).items() if plugins.REWARD in s}

            spec = {
                "mode": "serverless",
                "endpoint_url": "http://127.0.0.1:9",
                "stateful": ["judge"],
                "judge_model": "smollm2",
                "timeout_s": 60,
            }
            await client.register_plugin(plugins.RewardPlugin(["SERVERLESS"], **spec), name=plugins.REWARD)
            items = [{"reward": "judge", "function": None, "trajectory": _traj(a)} for a in ("8", "13")]
            items.append({"reward": "judge", "function": None, "trajectory": {"task": "math", "turns": [], "info": {}}})
            judged = await client.submit(tasks.reward_batch, items, **submit_kwargs("REWARD"))  # where the control plane sends them
            judged_stats = await stats()
            # local mode: the plugin on the REWARD pool only, with the run's (tiny) model as the judge
            spec = {"mode": "local", "stateful": ["judge"], "judge_model": str(model_dir)}
            await client.register_plugin(plugins.RewardPlugin(["REWARD"], **spec), name=plugins.REWARD)
            mixed = [{"reward": r, "function": None, "trajectory": _traj(a)} for r, a in (("math", "8"), ("judge", "8"), ("math", "5"))]
            local = await client.submit(tasks.reward_batch, mixed, **submit_kwargs("REWARD"))
            return judged, judged_stats, local, await stats()

    import torch

    threads = torch.get_num_threads()  # in-process workers set the torch threads of this process
    try:
        out, stats, local, local_stats = run_async(go(), timeout=240)
    finally:
        torch.set_num_threads(threads)
    assert [s for s, _ in out] == ["ok", "ok", "err"] and "no turns" in out[2][1]
    assert all(r["verdict"] in ("Yes", "No") and 0.0 <= r["score"] <= 1.0 for _, r in out[:2])
    assert stats["caller"]["judge_calls"] == 0 and stats["caller"]["n_local"] == 0  # the Lambda caller hosts no judge
    assert stats["judge-host"]["judge_calls"] == 2 and stats["judge-host"]["calls:judge"] == 3 and stats["judge-host"]["n_local"] == 1
    assert [s for s, _ in local] == ["ok", "ok", "ok"]
    assert local[0][1]["score"] == 1.0 and local[2][1]["score"] == 0.0  # the math verifier, in-process
    assert local[1][1]["verdict"] in ("Yes", "No")  # the judge, in the same batch
    assert set(local_stats) == {"judge-host"}  # local mode: no runner on the SERVERLESS worker
    assert local_stats["judge-host"]["calls:math"] == 2 and local_stats["judge-host"]["judge_calls"] == 1


def test_policy_as_judge_model_is_the_runs_own_model(tmp_path):
    """reward.judge_model: policy resolves to the run's model directory; a judge engine over it gives verdicts."""
    from rollart_dask.models.prepare import prepare_model
    from rollart_dask.control.reward_plane import RewardPlane
    from rollart_dask.data.reward_runner import RewardRunner

    cfg = load_flow(data=flow_dict(**{"tasks": [JUDGED_MATH], "reward.judge_model": "policy"}))
    plane = RewardPlane(cfg, tmp_path)
    spec = asyncio.run(plane.start())
    assert spec["mode"] == "local" and spec["stateful"] == ["judge"] and spec["judge_model"] == str(prepare_model(cfg))
    assert plane.where == {"judge": "REWARD (stateful: judge engine)"}
    runner = RewardRunner(**spec)
    out = runner.score_stateful([{"reward": "judge", "function": None, "trajectory": _traj(a)} for a in ("8", "2")])
    assert all(s == "ok" and r["verdict"] in ("Yes", "No") and 0.0 <= r["score"] <= 1.0 for s, r in out)
    row = plane.step_stats([runner.stats], wall_s=10.0, n_reserved=1)
    assert row["rewards"]["judge"]["calls"] == 2 and row["judge"]["calls"] == 2 and row["judge"]["model"] == spec["judge_model"]
    assert 0 < row["utilisation"] <= 1


def test_a_serverless_flow_with_a_judge_needs_a_reward_worker(tmp_path, run_async):
    import pytest
    from distributed import Client, SpecCluster, Worker

    from rollart_dask.resource.pools import PoolError, worker_resources
    from rollart_dask.control.reward_plane import RewardPlane

    cfg = load_flow(data=flow_dict(**{"tasks": [JUDGED_MATH], "reward.mode": "serverless"}))

    async def go():
        workers = {"caller": {"cls": Worker, "options": {"nthreads": 1, "resources": worker_resources(["SERVERLESS"]), "name": "caller"}}}
        async with (
            SpecCluster(workers=workers, asynchronous=True, silence_logs=40) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            await client.wait_for_workers(1)
            plane = RewardPlane(cfg, tmp_path)
            try:
                with pytest.raises(PoolError, match=r"pool REWARD \(stateful reward\(s\) judge: they stay local\) has no worker"):
                    await plane.start()
            finally:
                plane.close()
            return plane.functions

    assert run_async(go(), timeout=120) == {}  # nothing was deployed for the judge
