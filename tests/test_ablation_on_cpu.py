"""Ablations without a cluster: the synthetic workload env, the flow-level ideal on hand-checkable
cases, the ablation files, the report, and the emulated config rules."""

import csv

import pytest

from rollart_dask.envs.inject import parse_spec
from rollart_dask.envs.synthetic import SyntheticAgentEnv, length_mean
from rollart_dask.tools.ablation import ablation_names, load_ablation
from rollart_dask.tools.ablation.measure import engine_workers, fraction, reward_slots, summarise, variant_flow
from rollart_dask.tools.ablation.report import rows_of, write_report
from rollart_dask.config import FlowError, load_flow, task_pools
from rollart_dask.emulation import H800, QWEN3_8B
from rollart_dask.emulation.engine import EmulatedInstances
from rollart_dask.emulation.flow_ideal import flow_ideal
from rollart_dask.emulation.hardware import train_step_seconds, weight_load_seconds


def emulated_flow(**over) -> dict:
    task = {
        "name": "t",
        "env": "synthetic",
        "reward": "emulated",
        "affinity": "prefill",
        "max_tokens": 64,
        "env_args": {"turns": 2, "prompt_tokens": 1, "output_tokens": 1, "obs_tokens": 0},
    }
    task.update(over.pop("task", {}))
    flow = {
        "engine": {"backend": "emulated"},
        "trainer": {"backend": "emulated"},
        "emulation": {"pools": {"H800": {"gpu": "H800", "gpus": 1}, "H20": {"gpu": "H20", "gpus": 1}}, "trainer": {"gpus": 1}},
        "rollout": {"group_size": 2, "batch_groups": 2},
        "tasks": [task],
    }
    for k, v in over.items():
        flow[k] = {**flow.get(k, {}), **v}
    return flow


def test_synthetic_env_describes_each_turn_for_the_engine():
    env = SyntheticAgentEnv(turns=3, prompt_tokens=100, output_tokens=10, obs_tokens=5, success_p=1.0, reward_s=4, time_scale=0.5)
    _, info = env.reset(seed=7)
    assert info["emulate"] == {"prompt_tokens": 100, "output_tokens": 10} and info["emulated"]
    _, r, term, _, info = env.step("x")
    assert not term and info["emulate"] == {"prompt_tokens": 115, "output_tokens": 10}  # the whole conversation so far
    env.step("x")
    _, r, term, _, info = env.step("x")
    assert term and r == 1.0 and info["success"] and info["reward_s"] == 2.0  # emulated seconds × time_scale
    # prompts depend on the seed only (a GRPO group shares its prompt), responses are drawn per env
    spec = {"median": 500, "sigma": 0.8, "min": 10, "max": 4000}
    a, b = SyntheticAgentEnv(prompt_tokens=spec), SyntheticAgentEnv(prompt_tokens=spec)
    assert a.reset(seed=3)[1]["emulate"]["prompt_tokens"] == b.reset(seed=3)[1]["emulate"]["prompt_tokens"]
    assert 500 < length_mean(spec) < 800
    with pytest.raises(ValueError, match="length spec"):
        SyntheticAgentEnv(output_tokens={"mean": 3})


def test_normal_env_latency_is_truncated_at_zero():
    spec = parse_spec({"step_latency": {"dist": "normal", "mean_s": 5, "sd_s": 10}})
    assert spec.step_latency.value(-3.0, 0.5) == 0.0 and spec.step_latency.value(1.0, 0.5) == 15.0
    with pytest.raises(ValueError, match="normal"):
        parse_spec({"step_latency": {"dist": "gauss"}})


def test_emulated_flows_must_emulate_engine_and_trainer_together_and_share_one_clock():
    with pytest.raises(FlowError, match="emulated together"):
        load_flow(data=emulated_flow(trainer={"backend": "torch"}))
    cfg = load_flow(
        data=emulated_flow(task={"inject": {"step_latency": {"dist": "constant", "s": 1}}}), overrides=["emulation.time_scale=0.1"]
    )
    assert cfg.tasks[0].inject["time_scale"] == 0.1 and cfg.tasks[0].env_args["time_scale"] == 0.1
    with pytest.raises(FlowError, match="differs from emulation.time_scale"):
        load_flow(data=emulated_flow(task={"inject": {"time_scale": 1.0}}))
    with pytest.raises(FlowError, match="multiple of tp"):
        load_flow(data=emulated_flow(emulation={"pools": {"H800": {"gpu": "H800", "gpus": 3, "tp": 2}}}))


def test_ideal_of_a_hand_checkable_flow():
    # generation negligible (1-token prompts and outputs), constant env steps of 10 s, two turns, 4 trajectories
    inject = {"step_latency": {"dist": "constant", "s": 10}}
    data = emulated_flow(task={"inject": inject}, rollout={"mode": "sync"})
    cfg = load_flow(data=data)
    sync = flow_ideal(cfg, {"H800": 1}, samples=20)
    gen = sync.terms["group_latency_mean_s"] - 20  # what generation adds to a trajectory alone
    assert 0 < gen < 0.2
    train = train_step_seconds(QWEN3_8B, 1, 4 * (1 + 1 + 2 + 1), H800)  # per-turn samples: prompt + response
    assert sync.terms["train_s"] == pytest.approx(train)
    assert sync.step_s == pytest.approx(20 + gen + weight_load_seconds(QWEN3_8B, H800) + train, rel=1e-6)
    assert sync.terms["trajectory_latency_mean_s"] == pytest.approx(20 + gen)  # a trajectory's rollout alone: launch → reward
    # α=1 at trajectory level: every group must finish within one interval, so the slowest group sets the step
    safe = ["rollout.mode=rollart", "rollout.admission=safe"]
    r1 = flow_ideal(load_flow(data=data, overrides=[*safe, "rollout.alpha=1"]), {"H800": 1}, samples=20)
    assert r1.step_s == pytest.approx(20 + gen) and r1.binding.startswith("staleness")
    r2 = flow_ideal(load_flow(data=data, overrides=[*safe, "rollout.alpha=2"]), {"H800": 1}, samples=20)
    assert r2.step_s == pytest.approx((20 + gen) / 2)
    # eager α=1, groups of constant latency ℓ, 2 batches admitted: launched at phase u of an interval S, a group is trainable
    # iff ℓ ≤ (2−u)S, and an aborted one holds its admission until then; S = E[min(ℓ, w)] / (2 P(ℓ ≤ w)) solves to
    # 4.5 S² − 4ℓ S + ℓ²/2 = 0, S = ℓ (40 + √700) / 90 — above Little's law alone (ℓ/2): what outlives its window is lost
    eager = flow_ideal(
        load_flow(data=data, overrides=["rollout.mode=rollart", "rollout.admission=eager", "rollout.alpha=1"]), {"H800": 1}, samples=20
    )
    assert eager.step_s == pytest.approx((20 + gen) * (40 + 700**0.5) / 90, rel=5e-3) and eager.binding == "eager:trainable_groups"
    assert eager.terms["eager_trainable_mix"] == {"t": 1.0} and eager.terms["eager_trainable_share"] == pytest.approx(
        2 - 90 / (40 + 700**0.5), abs=0.02
    )  # u ≤ 2 − ℓ/S
    # local rewards two at a time: 4 rewards of 30 s take 60 s however fast the rest is
    slow = emulated_flow(task={"env_args": {"turns": 1, "prompt_tokens": 1, "output_tokens": 1, "reward_s": 30}})
    r = flow_ideal(load_flow(data=slow, overrides=["rollout.alpha=4"]), {"H800": 1}, reward_slots=2, samples=20)
    assert r.terms["reward_capacity_s"] == pytest.approx(60) and r.binding == "reward_capacity"


def test_an_emulated_flow_states_the_reward_reclaim_policy_in_emulated_seconds(tmp_path):
    from rollart_dask.control.reward_plane import RewardPlane

    emulated = load_flow(data=emulated_flow(reward={"mode": "serverless", "keep_warm_s": 180}, emulation={"time_scale": 0.05}))
    assert RewardPlane(emulated, tmp_path).keep_warm_wall_s() == pytest.approx(9.0)  # 180 emulated s at 0.05
    real = load_flow(data={"tasks": [{"name": "fl", "env": "frozenlake", "reward": "frozenlake"}], "reward": {"keep_warm_s": 180}})
    assert RewardPlane(real, tmp_path).keep_warm_wall_s() == 180


def test_heavy_env_tails_cost_the_batch_level_barrier_more():
    inject = {"step_latency": {"dist": "lognormal", "median_s": 2, "sigma": 1.5, "cap_s": 300}}
    data = emulated_flow(
        task={"inject": inject, "env_args": {"turns": 6, "prompt_tokens": 1, "output_tokens": 1}}, rollout={"batch_groups": 8}
    )
    batch = flow_ideal(load_flow(data=data, overrides=["rollout.level=batch", "rollout.alpha=1"]), {"H800": 1})
    traj = flow_ideal(load_flow(data=data, overrides=["rollout.alpha=1"]), {"H800": 1})
    assert batch.terms["makespan_s"] > 1.5 * traj.terms["latency_max_s"]


def test_every_shipped_ablation_loads_and_all_its_variants_are_emulated():
    names = ablation_names()
    assert {
        "fig10b_modes",
        "fig11a_affinity",
        "fig11b_weights",
        "fig12a_env_level",
        "fig12b_redundancy",
        "fig13_alpha",
        "fig14_reward",
    } <= set(names)
    for name in names:
        spec, path = load_ablation(name)
        for v in spec.variants:
            cfg = variant_flow(spec, path, v.name, quick=True, tiny=False, extra=[])
            assert cfg.emulated and engine_workers(cfg)
    spec, path = load_ablation("fig11a_affinity")
    costs = {}
    for v in spec.variants:  # equal normalised cost, within one GPU's worth
        e = variant_flow(spec, path, v.name, False, False, []).emulation
        used = {p for t in variant_flow(spec, path, v.name, False, False, []).tasks for p in task_pools(t)}
        costs[v.name] = sum(e.pools[p].gpus * {"H800": 2.85, "H20": 1.0}[e.pools[p].gpu] for p in used)
    assert max(costs.values()) - min(costs.values()) < 1.0, costs
    with pytest.raises(FlowError, match="unknown ablation"):
        load_ablation("fig99")


def test_reward_slots_follow_the_reward_mode():
    cfg = load_flow(data=emulated_flow())
    assert reward_slots(cfg) == 2  # the REWARD worker: two task threads, two batches in flight, each scored in turn
    assert reward_slots(load_flow(data=emulated_flow(), overrides=["reward.mode=serverless"])) is None


def _rows(gaps, trajectories=16):
    t, rows = 0.0, []
    for i, g in enumerate(gaps):
        t += g
        rows.append(
            {
                "kind": "step",
                "elapsed_s": t,
                "trajectories": trajectories,
                "trajectory_s": {"n": 4, "mean": 0.5},
                "reward": {"utilisation": 0.25},
                "pool_busy": {"H800": 0.5},
                "buffer": {"aborted_stale": i},
                "tasks": {"a": {"groups": 1}, "b": {"groups": 3}},
                "stage_latency": {"generate": {"n": 10, "sum_s": 1.5}},
                "service_s": {"generate": 0.5},
            }
        )
    return rows


def test_summary_and_report_put_ours_beside_the_ideal_and_the_paper(tmp_path):
    m = summarise(_rows([9, 9, 1, 1, 1]), scale=0.5, warmup=2)
    assert m["step_s"] == pytest.approx(2.0) and m["throughput"] == pytest.approx(8.0)  # 16 trajectories per 2 emulated s
    assert m["rollout_s"] == pytest.approx(1.0) and m["trained_mix"] == {"a": 0.25, "b": 0.75} and m["aborted"] == 4
    assert m["call_overhead_ms"] == {"generate": pytest.approx(100.0)}  # (1.5 s waited − 0.5 s inside) / 10 calls
    with pytest.raises(RuntimeError, match="steps"):
        summarise(_rows([1, 1]), 1.0, 2)
    assert fraction("step_s", 4.0, 2.0) == 0.5 and fraction("throughput", 1.0, 4.0) == 0.25
    spec, _ = load_ablation("fig13_alpha")
    results = [
        {
            "variant": v.name,
            "set": v.set,
            "time_scale": 0.5,
            "measured": dict(m, step_s=s),
            "ideal": {"step_s": s / 2, "throughput": 1.0, "binding": "train"},
            "simulated": {"step_s": s * 0.8, "trained_mix": {"a": 0.5, "b": 0.5}},
            "cost": {"measured": {"per_step": 2.0 * s, "per_trajectory": s / 8}, "ideal": {"per_trajectory": s / 16}},
        }
        for v, s in zip(spec.variants, [10, 5, 4, 4, 8])
    ]
    rows = rows_of(spec, results)
    assert [r["ours_vs_baseline"] for r in rows] == [1.0, 2.0, 2.5, 2.5, 1.25]  # speed-up of time vs α=0
    assert rows[1]["paper_vs_baseline"] == 2.05 and rows[1]["fraction_of_ideal"] == 0.5
    write_report(spec, results, tmp_path)
    md = (tmp_path / "results.md").read_text()
    # measured 5, simulated 4, ideal 2.5: the runtime keeps 0.8 of its policy's reach, the policy reaches 0.625 of the bound
    assert rows[1]["fraction_of_simulated"] == pytest.approx(0.8) and rows[1]["simulated_fraction_of_ideal"] == pytest.approx(0.625)
    assert "| α=1 | 5 | 4 | 2.5 | 0.5 | 0.8 | 0.625 | 2 |" in md and "| 10 / 0.625 (0.312) |" in md and "H20 = 1.00, H800 = 2.85" in md
    assert "(a:0.50 b:0.50)" in md
    assert len(list(csv.DictReader((tmp_path / "results.csv").open()))) == 5 and (tmp_path / "results.png").stat().st_size > 5000


def test_cost_of_a_hand_checkable_flow():
    """One H800 and one H20 engine GPU, a one-H800 trainer, one env host, a local reward GPU (H20): per hour
    2.85 + 1.00 + 2.85 + 1.00 units and the env host's $0.1785 in units; serverless bills only scored seconds."""
    from rollart_dask.emulation.cost import CPU_HOST_USD_HOUR, USD_PER_UNIT_HOUR, step_cost

    cfg = load_flow(
        data=emulated_flow(
            cluster={
                "workers": [
                    {"name": "train-0", "pools": ["H800", "TRAIN"]},
                    {"name": "h800-0", "pools": ["H800"]},
                    {"name": "h20-0", "pools": ["H20"]},
                    {"name": "cpu-0", "pools": ["CPU"]},
                    {"name": "reward-0", "pools": ["SERVERLESS", "REWARD"]},
                ]
            }
        )
    )
    workers = engine_workers(cfg)
    cpu = CPU_HOST_USD_HOUR / USD_PER_UNIT_HOUR
    assert USD_PER_UNIT_HOUR == pytest.approx(2.414, abs=1e-3)
    local = step_cost(cfg, workers, step_s=1800, trajectories=10, reward_s_per_trajectory=36)
    assert {k: round(v, 6) for k, v in local["parts"].items()} == {
        "gpu:H800": 1.425,
        "gpu:TRAIN": 1.425,
        "gpu:REWARD": 0.5,
        "cpu": round(cpu / 2, 6),
    }  # half an hour of each (no H20 task here)
    assert local["per_trajectory"] == pytest.approx(local["per_step"] / 10)
    cfg = load_flow(data=emulated_flow(reward={"mode": "serverless"}, cluster=cfg.cluster.model_dump()))
    serverless = step_cost(cfg, workers, step_s=1800, trajectories=10, reward_s_per_trajectory=36)
    assert "gpu:REWARD" not in serverless["parts"] and serverless["parts"]["serverless"] == pytest.approx(10 * 36 / 3600 * 1.00)


def test_stream_prefix_cache_serves_the_conversation_so_far():
    e = EmulatedInstances(2, time_scale=0.0)
    first = e.generate([{"id": "t1#a", "prompt": "", "emulate": {"prompt_tokens": 1000, "output_tokens": 50}}])[0]
    assert len(first.prompt_ids) == 1000 and len(first.token_ids) == 50 and isinstance(first.token_ids, range)
    e.generate([{"id": "t1#b", "prompt": "", "emulate": {"prompt_tokens": 1100, "output_tokens": 5}}])  # turn 2 extends turn 1
    st = e.stats
    assert st["cached_tokens"] == (1050 // 16) * 16 and st["instances"] == 2  # whole blocks of prompt + response, same instance
    e.reset_prefix_cache()
    e.generate([{"id": "t1#c", "prompt": "", "emulate": {"prompt_tokens": 1200, "output_tokens": 5}}])
    assert e.stats["cached_tokens"] == st["cached_tokens"]  # nothing more was served after the reset


def test_report_only_reports_the_runs_already_there_and_names_a_missing_one(tmp_path):
    """--report-only reads each variant's metrics.jsonl under OUT (no cluster): measured from those rows, the ideal and
    the simulation recomputed; a variant never run is an error naming it and where it looked."""
    import json

    from rollart_dask.config import FlowError
    from rollart_dask.tools.ablation.measure import _slug, run_ablation

    spec, path = load_ablation("fig14_reward")
    first = spec.variants[0]
    run_dir = tmp_path / "runs" / _slug(first.name)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _rows([9, 9, 1, 1, 1])) + "\n")
    with pytest.raises(FlowError, match=r"no run of variant 'serverless' under .*runs/serverless"):
        run_ablation(spec, path, tmp_path, tiny=True, report_only=True)
    spec.variants = [first]
    [r] = run_ablation(spec, path, tmp_path, tiny=True, report_only=True)
    assert r["measured"]["step_s"] == pytest.approx(
        1.0 / 0.005
    )  # 1 s gaps at the tiny time scale and r["simulated"]["step_s"] > 0 and r["ideal"]["step_s"] > 0
    assert (tmp_path / "results.md").is_file()
