"""The real runtime on emulated hardware: streamed calls, the staleness bound under eager admission,
and every ablation end to end at a tiny scale."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollart_dask.config import load_flow
from tests.conftest import check_staleness_by_turns, record_trained_batches


def test_a_slow_env_call_does_not_hold_back_its_batch(address, run_async):
    """Two resets in one tick share one Dask future, yet each answers when it is done (streamed)."""
    from distributed import Client

    from rollart_dask.control.dispatch import Dispatcher
    from rollart_dask.resource.pools import PoolMap
    from rollart_dask.data import plugins, tasks

    async def go():
        client = await Client(address, asynchronous=True)
        try:
            await client.register_plugin(plugins.EnvHostPlugin(["CPU"]), name=plugins.ENVHOST)
            cpu = PoolMap.from_scheduler_info(await client.scheduler.identity()).members("CPU")[0]
            d = Dispatcher(client)
            done = {}

            async def reset(name, seconds):
                item = {
                    "traj_id": name,
                    "env": "synthetic",
                    "env_args": {},
                    "seed": 1,
                    "member": "0",
                    "inject": {"reset_latency": {"dist": "constant", "s": seconds}},
                }
                t0 = time.monotonic()
                obs, info = await d.call("env-reset", tasks.env_reset_stream, item, pool="CPU", worker=cpu, timeout=30, streamed=True)
                done[name] = time.monotonic() - t0
                return info

            infos = await asyncio.gather(reset("slow", 4.0), reset("fast", 0.0))
            d.close()
            return done, infos, d.futures, d.batch_sizes["env-reset"]
        finally:
            await client.close()

    done, infos, futures, sizes = run_async(go(), timeout=120)
    assert futures == 1 and sizes == [2]  # coalesced into one task
    assert done["fast"] < 2.0 < 4.0 <= done["slow"] + 0.1, done  # yet the fast one did not wait for the slow one
    assert all(i["injected"]["emulated"] and i["emulate"]["prompt_tokens"] == 512 for i in infos)


def _emulated_flow(tmp_path: Path, *overrides: str):
    data = yaml.safe_load(Path("flows/ablations/workloads/multitask.yaml").read_text())
    return load_flow(
        data=data,
        overrides=["trainer.steps=5", "emulation.time_scale=0.005", "rollout.batch_groups=2", "observe.watchdog_s=60", *overrides],
    )


@pytest.mark.parametrize("alpha", [1, 2])
def test_emulated_run_keeps_every_trained_sample_within_the_staleness_bound(tmp_path, run_async, alpha):
    from rollart_dask.entry.api import run_flow

    cfg = _emulated_flow(tmp_path, f"rollout.alpha={alpha}", "rollout.admission=eager")
    batches: list = []
    result = run_async(run_flow(cfg, tmp_path, on_ready=lambda run: record_trained_batches(run, batches)), timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert result["steps"] == 5 and len(steps) == 5
    check_staleness_by_turns(batches, steps, alpha)  # by the versions the (emulated) engines stamped on every turn
    for r in steps:
        assert max(int(k) for k in r["staleness"]) <= alpha, r["staleness"]
        # its two parts, each within the bound: versions installed while a trajectory ran, and while it waited to train
        assert 0 <= r["lag_in_flight_max"] <= alpha and 0 <= r["lag_in_queue_max"] <= alpha and r["queue_s_max"] >= 0, r
        assert r["trajectories"] == 16 and r["emulated_train_s"] > 0 and r["trainer"] == "emulated"
    effective = yaml.safe_load((tmp_path / "flow.yaml").read_text())["_effective"]
    assert "Qwen3-8B" in effective["emulated"]["hardware"] and effective["engine_backend"] == "emulated"


@pytest.mark.parametrize("pull", ["background", "at_update"])
def test_an_emulated_weight_transfer_is_hidden_behind_rollout_unless_pulled_at_update(tmp_path, run_async, pull):
    """The cross-cluster transfer of the profile's weights (Qwen3-8B, 16.4 GB, 2 generation nodes, 1 training node) over
    an ASSUMED 0.55 GB/s link: 60 emulated s, 0.3 s on the wall. Pulled in the background it overlaps rollout; pulled at
    Update (the synchronous baseline) the loop waits through all of it, generation suspended."""
    from rollart_dask.entry.api import run_flow

    cfg = _emulated_flow(tmp_path, "rollout.alpha=1", f"weights.pull={pull}", "emulation.weight_link_gbps=0.5467")
    run_async(run_flow(cfg, tmp_path), timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    pulls = [r["weights"] for r in rows if r["kind"] == "step" and "weights" in r]
    assert len(pulls) >= 3
    assert all(p["transfer_s"] >= 0.28 for p in pulls), pulls  # the emulated link was slept, every version
    if pull == "at_update":
        # the loop waits from the stage's submission on: all but a sliver of the transfer (a share, not a wall-clock bound)
        assert all(p["hidden_s"] < 0.1 * p["transfer_s"] and p["waited_s"] >= 0.28 for p in pulls), pulls
    else:
        # (overlap, not a speed target: at update it is under a tenth of the transfer; on a loaded 2-core runner about half is hidden)
        assert sum(p["hidden_s"] for p in pulls) > 0.25 * sum(p["transfer_s"] for p in pulls), pulls


def open_envs(dask_worker=None) -> int:
    plugin = dask_worker.plugins.get("rollart-envhost")
    return len(plugin.service.envs) if plugin is not None and plugin.service is not None else 0


def test_a_stopped_run_leaves_no_env_open_on_an_attached_cluster(address, tmp_path, run_async):
    """Eager admission keeps trajectories in flight to the end; the stop cancels them, and each one's env close must
    reach its worker before the run's channels shut: on a cluster the run only attached to, the env hosts live on."""
    from distributed import Client

    from rollart_dask.entry.api import run_flow

    # time scale 0.05: env steps of ~25–150 ms, so a close waits for the step it comes during and holds its slot meanwhile
    # (α = 1: the last weight install aborts stale trajectories just before the stop; one batch per service in flight)
    cfg = _emulated_flow(
        tmp_path,
        f"cluster.scheduler={address}",
        "trainer.steps=2",
        "rollout.alpha=1",
        "rollout.admission=eager",
        "emulation.time_scale=0.05",
        "rollout.coalesce_inflight=1",
    )
    in_flight: list = []

    def count_at_stop(run) -> None:  # trajectories holding an env when the stop cancels them
        stop = run.launcher.stop

        async def stop_counting() -> None:
            in_flight.append(len(run.services.em.where))
            await stop()

        run.launcher.stop = stop_counting

    async def go():
        result = await run_flow(cfg, tmp_path, on_ready=count_at_stop)
        async with Client(address, asynchronous=True) as c:
            return result, await c.run(open_envs)

    result, envs = run_async(go(), timeout=300)
    assert result["steps"] == 2 and in_flight[0] > 0  # the stop did cancel trajectories holding envs
    assert sum(envs.values()) == 0, envs


@pytest.mark.slow
def test_rollart_ablate_all_runs_every_figure_at_a_tiny_scale(tmp_path):
    out = tmp_path / "ablations"
    proc = subprocess.run(
        [sys.executable, "-m", "rollart_dask.entry.cli", "ablate", "all", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in (
        "fig10b_modes",
        "fig11a_affinity",
        "fig11b_weights",
        "fig12a_env_level",
        "fig12b_redundancy",
        "fig13_alpha",
        "fig14_reward",
        "fairness",
    ):
        md = (out / name / "results.md").read_text()
        assert "EMULATED" in md and "paper, " in md and "Where the time beyond the ideal goes" in md
        rows = (out / name / "results.csv").read_text().splitlines()
        assert len(rows) >= 3 and (out / name / "results.png").stat().st_size > 5000
        results = json.loads((out / name / "results.json").read_text())
        assert all(r["measured"]["step_s"] > 0 and r["ideal"]["step_s"] > 0 for r in results)
    fair = {r["variant"]: r for r in json.loads((out / "fairness" / "results.json").read_text())}
    assert fair["sync"]["measured"]["mix_shift_pp"] == 0 and fair["α=1 fair"]["measured"]["launched_mix"]
    assert "Mix shift" in (out / "fairness" / "results.md").read_text()


@pytest.mark.parametrize("partial", ["restart", "continue"])
def test_a_turn_a_weight_update_interrupts_restarts_or_continues_with_a_version_per_token(tmp_path, run_async, partial):
    """Suspend aborts the turns generating at each weight update. restart: generated again under the new weights (the
    partial response discarded, counted); continue: on from the prefix, each token keeping the version that made it —
    per-token versions reach the trained batch and the trainer, which reports how far behind its tokens are."""
    from rollart_dask.entry.api import run_flow

    # the turns long enough to be interrupted are the slow task's: without fairness none of them is trained in 5 steps
    # (8 steps: in 5, a loaded machine sometimes trained none of the interrupted turns yet)
    cfg = _emulated_flow(
        tmp_path, "rollout.alpha=4", "rollout.admission=eager", "rollout.fairness=task", f"rollout.partial={partial}", "trainer.steps=8"
    )
    batches: list = []
    run_async(run_flow(cfg, tmp_path, on_ready=lambda run: record_trained_batches(run, batches)), timeout=600)
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if r["kind"] == "step"]
    check_staleness_by_turns(batches, steps, 4)  # a continued turn's first token counts for its trajectory's staleness
    tokens = steps[-1]["rollout_tokens"]
    assert 0 < tokens["trained"] < tokens["generated"]
    mixed = sum(r["mixed_version_turns"] for r in steps)
    if partial == "continue":
        assert tokens["continued"] > 0 and tokens["discarded"] == 0 and mixed > 0
        assert max(r["token_lag_max"] for r in steps) >= 1
    else:
        assert tokens["discarded"] > 0 and tokens["continued"] == 0 and mixed == 0


def test_max_trained_lag_bounds_every_trained_token_of_continued_turns_tighter_than_alpha(tmp_path, run_async):
    """α=4 lets groups run four versions ahead and continued turns carry tokens of older versions; with
    rollout.max_trained_lag=1 no trained token is more than one version behind the trainer that trains it (the trainer
    measures it), Get Batch having evicted what was older, so that the trainer's own guard dropped nothing."""
    from rollart_dask.entry.api import run_flow

    cfg = _emulated_flow(
        tmp_path, "rollout.alpha=4", "rollout.max_trained_lag=1", "rollout.admission=eager", "rollout.partial=continue", "trainer.steps=6"
    )
    result = run_async(run_flow(cfg, tmp_path), timeout=600)
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").open()) if r["kind"] == "step"]
    assert len(steps) == 6 and all(r["token_lag_max"] <= 1 for r in steps), [r["token_lag_max"] for r in steps]
    assert result["counts"]["samples_over_lag_dropped"] == 0
    stale = result["accounting"]["evicted_stale"] + result["accounting"]["aborted_stale"]
    assert stale > 0, result["accounting"]  # the bound did evict: α alone would have trained them


@pytest.mark.slow
def test_affinity_auto_profiles_the_tasks_then_moves_them_to_the_mapping_predicted_fastest(tmp_path, run_async):
    """Both tasks generate on either pool while they are profiled; at the step boundary after the decision
    every new generate call of a task lands on the pool its chosen affinity names."""
    from rollart_dask.entry.api import run_flow

    data = yaml.safe_load(Path("flows/ablations/workloads/multitask.yaml").read_text())
    data["tasks"] = [t for t in data["tasks"] if t["name"] in ("frozenlake", "math")]
    cfg = load_flow(
        data=data,
        overrides=[
            "trainer.steps=16",
            "emulation.time_scale=0.02",
            "rollout.batch_groups=2",
            "observe.watchdog_s=60",
            "emulation.pools.H800.gpus=2",
            "emulation.pools.H20.gpus=2",
            "tasks.frozenlake.affinity=auto",
            "tasks.math.affinity=auto",
            "placement.profile_steps=1",
            "placement.sim_seeds=1",
            "placement.sim_steps=4",
        ],
    )
    result = run_async(run_flow(cfg, tmp_path), timeout=600)
    placed = result["placement"]
    assert placed["mapping"] is not None, placed
    ranking = placed["ranking"]
    assert len(ranking) == 9 and placed["mapping"] == ranking[0]["mapping"] and placed["simulated_step_s"] == ranking[0]["step_s"]
    # the steps before the switch (every task on any pool) measured the runtime's cost: it scales the simulated step times
    before = next(r for r in ranking if set(r["mapping"].values()) == {"any"})
    assert placed["applied_at_step"] >= 3 and placed["runtime_factor"] != 1.0
    assert (
        placed["predicted_step_s"] == pytest.approx(placed["runtime_factor"] * placed["simulated_step_s"])
        and before["predicted_step_s"] > 0
    )
    assert placed["measured_step_s"] > 0 and placed["steps_measured"] >= 1
    # beside the printed prediction: the factor the steps after the switch would have given, and the measured mean's noise
    assert placed["refit_factor"] == pytest.approx(placed["measured_step_s"] / placed["simulated_step_s"])
    assert placed["steps_measured"] < 2 or placed["measured_se_s"] > 0
    decision = json.loads((tmp_path / "placement.json").read_text())
    fl, math = decision["profile"]["frozenlake"], decision["profile"]["math"]
    assert fl["prefix_hit"] > 0.5 and fl["turns"] > 4 and fl["obs_tokens"] == 400  # a multi-turn chat: the conversation repeats
    assert math["turns"] == 1 and math["prefix_hit"] == 0 and math["lengths_from"] == "asked"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    [row] = [r for r in rows if r["kind"] == "placement"]
    assert row["mapping"] == placed["mapping"] and row["pd"] is None and row["step"] == placed["applied_at_step"] >= 1
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    after = steps[row["step"] + 1]["generate_pools"]
    pool = {"prefill": ["H800"], "decode": ["H20"], "any": ["H800", "H20"]}
    for task, affinity in placed["mapping"].items():  # from one step after the switch on, calls land only where it says
        new = {p: n - after[task].get(p, 0) for p, n in result["generate_pools"][task].items()}
        assert sum(new.values()) > 0 and all(n == 0 for p, n in new.items() if p not in pool[affinity]), (task, affinity, new)


def test_pd_auto_starts_undisaggregated_then_takes_the_route_predicted_fastest(tmp_path, run_async):
    """Long prompts, short answers, 1 H800 + 1 H20: the run measures its tasks undisaggregated, predicts that
    prefilling on H800 and decoding on H20 beats no disaggregation, and from the step boundary after the decision
    every call is prefilled on H800 and decoded on H20 (none before it). The decision is simulated in a process at
    nice 19, so on a loaded machine it takes longer: the run goes on until four steps past it, not a fixed number."""
    from rollart_dask.entry.api import run_flow

    cfg = load_flow(
        "flows/ablations/workloads/long_prompts.yaml",
        overrides=[
            "trainer.steps=200",
            "emulation.time_scale=0.01",
            "rollout.batch_groups=2",
            "observe.watchdog_s=60",
            "placement.profile_steps=1",
            "placement.sim_seeds=1",
            "placement.sim_steps=4",
        ],
    )

    def stop_past_the_decision(run):
        decided = run.placement.decided
        if decided is not None and run.published >= decided["applied_at_step"] + 4:
            run.request_stop()

    result = run_async(run_flow(cfg, tmp_path, on_step=stop_past_the_decision), timeout=600)
    placed = result["placement"]
    assert result["steps"] < 200, "the decision never came"
    assert placed["pd"] == {"prefill": "H800", "decode": "H20"} and placed["mapping"] == {}, placed
    assert [r["pd"] for r in placed["ranking"]][0] == placed["pd"] and len(placed["ranking"]) == 3
    assert placed["applied_at_step"] >= 2 and placed["measured_step_s"] > 0 and placed["predicted_step_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    [row] = [r for r in rows if r["kind"] == "placement"]
    assert row["pd"] == placed["pd"] and row["step"] == placed["applied_at_step"]
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    before, last = steps[row["step"]], steps[max(steps)]
    assert before["pd"]["prefill_requests"] == 0  # undisaggregated until the decision
    assert last["pd"]["prefill_requests"] > 0 and last["pd"]["decode_requests"] > 0 and last["pd"]["kv_bytes_shipped"] > 0
    pools_after = {
        t: {p: n - steps[row["step"] + 1]["generate_pools"][t].get(p, 0) for p, n in by_pool.items()}
        for t, by_pool in result["generate_pools"].items()
    }
    for task, new in pools_after.items():  # a routed call is answered by its decode worker: every new one on H20
        assert new.get("H20", 0) > 0 and new.get("H800", 0) == 0, (task, new)
