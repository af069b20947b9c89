"""affinity auto (control/placement.py): the profile measured from a task's own calls, the synthetic workload it
becomes, the predictor's ranking, and the flow's rules — without a cluster."""

from types import SimpleNamespace

import pytest
import yaml

from rollart_dask.config import load_flow, task_pool, task_pools
from rollart_dask.control.placement import Profiler, common_prefix, fit_lengths, profiled_flow
from rollart_dask.types import Turn

from conftest import flow_dict

WORKLOAD = "flows/ablations/workloads/multitask.yaml"


def _workload(**affinity):
    data = yaml.safe_load(open(WORKLOAD).read())
    data["tasks"] = [t for t in data["tasks"] if t["name"] in ("frozenlake", "math")]
    return load_flow(
        data=data,
        overrides=["emulation.pools.H800.gpus=2", "emulation.pools.H20.gpus=2", *(f"tasks.{t}.affinity={a}" for t, a in affinity.items())],
    )


def _turn(prompt, response):
    return Turn(observation="", prompt_ids=list(prompt), response_ids=list(response), logprobs=[], allowed_ids=None, version=0)


def test_common_prefix_and_length_fits():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix(range(10), range(6)) == 6 and common_prefix([], [1]) == 0
    assert fit_lengths([7, 7, 7]) == 7
    fit = fit_lengths([10, 100, 1000])
    assert fit["min"] == 10 and fit["max"] == 1000 and abs(fit["median"] - 100) < 0.5 and fit["sigma"] > 1


def test_the_profiler_measures_first_prompts_new_tokens_responses_turns_and_prefix_reuse():
    p = Profiler()
    for traj in range(4):  # 3 turns: a 100-token prompt, then 20 new observation tokens after each 10-token response
        turns, prompt = [], list(range(100))
        for k in range(3):
            response = [1000 + traj * 10 + k] * 10
            p.observe("fl", turns, SimpleNamespace(prompt_ids=prompt, token_ids=response))
            turns.append(_turn(prompt, response))
            prompt = prompt + response + list(range(500, 520))
    p.observe("math", [], SimpleNamespace(prompt_ids=list(range(30)), token_ids=[5] * 300))
    # an EMULATED request says its length when asked: the long ones still generating count too (capped at max_tokens)
    p.asked("swe", 0, {"output_tokens": 5000}, max_tokens=4000)
    p.asked("swe", 0, {"output_tokens": 50}, max_tokens=4000)
    p.observe("swe", [], SimpleNamespace(prompt_ids=list(range(30)), token_ids=[5] * 50))
    prof = p.profile()
    assert prof["swe"]["output_tokens"]["max"] == 4000 and prof["swe"]["lengths_from"] == "asked"
    fl = prof["fl"]
    assert fl["trajectories"] == 4 and fl["turns"] == 3 and fl["prompt_tokens"] == 100 and fl["output_tokens"] == 10
    assert fl["obs_tokens"] == 20  # the new tokens of later turns: what the conversation added
    assert fl["prefix_hit"] == pytest.approx((110 + 140) / (100 + 130 + 160))  # per trajectory: reused / prompt tokens
    assert prof["math"] == {
        "trajectories": 1,
        "turns": 1.0,
        "lengths_from": "answered",
        "prompt_tokens": 30,
        "output_tokens": 300,
        "obs_tokens": 0,
        "prefix_hit": 0.0,
    }
    p.active = False  # after the decision started, later turns are not counted
    p.observe("math", [], SimpleNamespace(prompt_ids=[1], token_ids=[1]))
    assert p.profile()["math"]["trajectories"] == 1


def test_a_profile_becomes_a_synthetic_workload_and_every_mapping_is_ranked():
    from rollart_dask.emulation.placement import rank_mappings

    cfg = _workload(frozenlake="auto", math="auto")
    assert [task_pool(t) for t in cfg.tasks] == [None, None] and task_pools(cfg.tasks[0]) == ("H800", "H20")  # any, until placed
    profile = {
        "frozenlake": {"turns": 8, "prompt_tokens": 1200, "obs_tokens": 400, "output_tokens": 48, "prefix_hit": 0.8},
        "math": {"turns": 1, "prompt_tokens": 300, "obs_tokens": 0, "output_tokens": 3000, "prefix_hit": 0.0},
    }
    flow = profiled_flow(cfg, profile, steps=5)
    fl = next(t for t in flow["tasks"] if t["name"] == "frozenlake")
    assert fl["env_args"]["obs_tokens"] == 400 and fl["env_args"]["success_p"] == 0.5 and fl["affinity"] == "any"
    ranking = rank_mappings(flow, ["frozenlake", "math"], {"H800": 1, "H20": 1}, seeds=1)
    assert len(ranking) == 9 and [r["step_s"] for r in ranking] == sorted(r["step_s"] for r in ranking)
    assert {tuple(r["mapping"].values()) for r in ranking} == {
        (a, b) for a in ("prefill", "decode", "any") for b in ("prefill", "decode", "any")
    }
    assert ranking[-1]["step_s"] > 1.1 * ranking[0]["step_s"]  # on small pools the mapping matters
    assert task_pool(cfg.tasks[1], placed={"math": "decode"}) == "H20"


def test_auto_needs_the_pools_hardware_and_a_profile_of_every_task():
    with pytest.raises(Exception, match="affinity auto predicts each mapping's step time from the pools' hardware profiles"):
        load_flow(data=flow_dict(**{"tasks": [{"name": "fl", "env": "frozenlake", "reward": "frozenlake", "affinity": "auto"}]}))
    cfg = load_flow(data=flow_dict(**{"tasks": [{"name": "fl", "env": "frozenlake", "reward": "frozenlake"}]}))
    assert cfg.tasks[0].affinity == "any" and task_pool(cfg.tasks[0]) is None  # the default: either engine pool
    emulated = _workload(frozenlake="auto")
    emulated.tasks[0].env = "frozenlake"  # a task with no measured profile and no synthetic shape of its own
    with pytest.raises(Exception, match="task frozenlake has no measured profile"):
        profiled_flow(emulated, {}, steps=5)


def test_a_previous_runs_profile_places_the_tasks_before_rollout(tmp_path):
    import asyncio
    import json

    from rollart_dask.control.placement import AutoPlacement

    profile = {
        "frozenlake": {"turns": 8, "prompt_tokens": 1200, "obs_tokens": 400, "output_tokens": 48, "prefix_hit": 0.8},
        "math": {"turns": 1, "prompt_tokens": 300, "obs_tokens": 0, "output_tokens": 3000, "prefix_hit": 0.0},
    }
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "placement.json").write_text(json.dumps({"profile": profile, "runtime_factor": 1.25}))
    cfg = _workload(frozenlake="auto", math="decode")
    cfg.placement.profile_from, cfg.placement.sim_seeds, cfg.placement.sim_steps = str(tmp_path / "before"), 1, 4
    placement = AutoPlacement(cfg, tmp_path / "run", lambda: {"H800": 1, "H20": 1})
    asyncio.run(placement.start())
    decided = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert decided["profile_source"].endswith("placement.json") and decided["profiled_at_step"] == 0
    assert set(decided["mapping"]) == {"frozenlake"} and len(decided["ranking"]) == 3  # only the auto task is placed
    assert placement.placed == {"frozenlake": decided["mapping"]["frozenlake"]} and not placement.profiler.active
    # the earlier run's measured cost of the runtime scales the simulated step times
    assert decided["runtime_factor"] == 1.25 and decided["predicted_step_s"] == pytest.approx(1.25 * decided["simulated_step_s"])
    cfg.placement.profile_from = str(tmp_path / "nowhere")
    with pytest.raises(Exception, match="placement.profile_from: .* holds no profile"):
        asyncio.run(AutoPlacement(cfg, tmp_path / "run2", lambda: {"H800": 1, "H20": 1}).start())


LONG_PROMPTS = {
    "frozenlake": {"turns": 4, "prompt_tokens": 16000, "obs_tokens": 4000, "output_tokens": 300, "prefix_hit": 0.8},
    "math": {"turns": 1, "prompt_tokens": 12000, "obs_tokens": 0, "output_tokens": 600, "prefix_hit": 0.0},
}


def test_pd_auto_ranks_disaggregation_either_way_beside_every_mapping_and_the_kv_link_counts():
    from rollart_dask.emulation.placement import predict, rank_mappings

    cfg = _workload(frozenlake="auto", math="auto")
    cfg.rollout.pd = "auto"
    flow = profiled_flow(cfg, LONG_PROMPTS, steps=6)
    assert flow["rollout"]["pd"] is None  # each candidate sets its own
    ranking = rank_mappings(flow, ["frozenlake", "math"], {"H800": 1, "H20": 1}, seeds=1, pd_auto=True)
    routes = [r["pd"] for r in ranking if r["pd"]]
    assert len(ranking) == 11 and sorted(map(str, routes)) == sorted(
        map(str, [{"prefill": "H800", "decode": "H20"}, {"prefill": "H20", "decode": "H800"}])
    )
    # long prompts, short answers: prefill on the compute-bound pool and decode on the bandwidth-bound one beats every mapping
    assert ranking[0]["pd"] == {"prefill": "H800", "decode": "H20"} and ranking[1]["step_s"] > 1.2 * ranking[0]["step_s"]
    assert ranking[-1]["step_s"] > 2 * ranking[0]["step_s"]
    # the KV cache crosses the link every turn: a slow link makes the same route slower
    from rollart_dask.config import FlowConfig

    base = FlowConfig.model_validate(flow)
    slow = base.model_copy(deep=True)
    slow.emulation.kv_link_gbps = 0.05
    route = {"prefill": "H800", "decode": "H20"}
    mapping = {"frozenlake": "any", "math": "any"}
    assert (
        predict(slow, mapping, {"H800": 1, "H20": 1}, 1, route)["step_s"]
        > 1.2 * predict(base, mapping, {"H800": 1, "H20": 1}, 1, route)["step_s"]
    )


def test_pd_auto_is_applied_to_the_proxys_route_and_needs_both_pools(tmp_path):
    import asyncio
    import json

    from rollart_dask.control.placement import AutoPlacement
    from rollart_dask.resource.check import needed_pools

    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "placement.json").write_text(json.dumps({"profile": LONG_PROMPTS}))
    cfg = _workload(frozenlake="decode", math="prefill")
    cfg.rollout.pd = "auto"
    cfg.placement.profile_from, cfg.placement.sim_seeds, cfg.placement.sim_steps = str(tmp_path / "before"), 1, 5
    assert {"H800", "H20"} <= set(needed_pools(cfg))
    proxy = SimpleNamespace(pd=None)
    placement = AutoPlacement(cfg, tmp_path / "run", lambda: {"H800": 1, "H20": 1}, proxy)
    asyncio.run(placement.start())
    decided = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert len(decided["ranking"]) == 3 and decided["mapping"] == {}  # no auto task: off (their own affinities) or either way
    assert decided["pd"] == {"prefill": "H800", "decode": "H20"} and (proxy.pd.prefill, proxy.pd.decode) == ("H800", "H20")
    with pytest.raises(Exception, match=r"rollout.pd: auto predicts each choice's step time"):
        load_flow(data=flow_dict(**{"rollout": {"pd": "auto"}}))
    with pytest.raises(Exception, match=r"affinity auto with a fixed rollout.pd"):
        _workload(frozenlake="auto").model_copy(update={}).model_validate(
            {
                **_workload().model_dump(mode="json", exclude={"imports"}),
                "rollout": {"pd": {"prefill": "H800", "decode": "H20"}},
                "tasks": [{**t, "affinity": "auto"} for t in _workload().model_dump(mode="json")["tasks"]],
            }
        )
    both = _workload(frozenlake="auto", math="auto").model_dump(mode="json", exclude={"imports"})
    both["rollout"]["pd"] = "auto"
    assert type(_workload()).model_validate(both).rollout.pd == "auto"  # both automatic: allowed
