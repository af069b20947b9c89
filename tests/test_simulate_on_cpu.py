"""The policy simulator (rollart_dask/emulation/simulate.py) without a cluster: processor sharing, and the
policy's step on cases whose answer is known — a deterministic synchronous step, a train-bound step, the staleness
bound's bias against a slow task, and a policy that can never make a step."""

import numpy as np
import pytest

from rollart_dask.config import load_flow
from rollart_dask.tools.ablation.measure import engine_workers, ideal_of, reward_slots
from rollart_dask.emulation.hardware import GPUS, MODELS, train_step_seconds, weight_load_seconds, weight_transfer_seconds
from rollart_dask.emulation.sharing import fill_level, water_fill
from rollart_dask.emulation.simulate import simulate


def flow(tasks: list[dict], **over) -> object:
    data = {
        "engine": {"backend": "emulated"},
        "trainer": {"backend": "emulated", "steps": 8},
        "emulation": {
            "time_scale": 0.05,
            "pools": {"H800": {"gpu": "H800", "gpus": 8}, "H20": {"gpu": "H20", "gpus": 8}},
            "trainer": {"gpus": 8},
        },
        "rollout": {"group_size": 4, "batch_groups": 4},
        "tasks": tasks,
    }
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v}
    return load_flow(data=data)


def task(name: str, turns: int = 1, reset_s: float = 10.0, step_s: float = 5.0, **inject) -> dict:
    return {
        "name": name,
        "env": "synthetic",
        "reward": "emulated",
        "affinity": "prefill",
        "max_tokens": 64,
        "max_turns": turns,
        "env_args": {"turns": turns, "prompt_tokens": 16, "output_tokens": 1, "obs_tokens": 0},
        "inject": {"reset_latency": {"dist": "constant", "s": reset_s}, "step_latency": {"dist": "constant", "s": step_s}, **inject},
    }


def run(cfg, **kw):
    return simulate(cfg, engine_workers(cfg), reward_slots(cfg), **kw)


def test_processor_sharing_gives_what_the_capped_leave_to_the_rest():
    assert water_fill(2.0, {"a": 0.5, "b": 5.0, "c": 5.0}) == {"a": 0.5, "b": 0.75, "c": 0.75}
    assert water_fill(2.0, {"a": 0.5, "b": 0.25}) == {"b": 0.25, "a": 0.5}  # all below their share: each at its top
    # a pool's free slots (top rate 0) take no share; a turn without latency (top rate inf) takes what is left
    assert fill_level(2.0, np.array([0.0, 0.0, 0.5, 5.0, 5.0])) == 0.75
    assert water_fill(2.0, {"a": 0.5, "b": float("inf")}) == {"a": 0.5, "b": 1.5}


def test_a_deterministic_synchronous_step_is_its_parts_in_sequence():
    """Sync: a wave resets (10 s), generates one token, steps (5 s), is rewarded; then the update and the Train, in turn."""
    cfg = flow([task("t")], rollout={"mode": "sync"})
    sim = run(cfg)
    model = MODELS["Qwen3-8B"]
    train = train_step_seconds(model, 8, 16 * 17, GPUS["H800"])  # 16 trajectories of one 17-token sample
    update = weight_load_seconds(model, GPUS["H20"])
    assert 15.0 + train + update < sim.step_s < 15.0 + train + update + 0.1  # + one token's generation
    assert sim.step_s == pytest.approx(ideal_of(cfg)["step_s"], rel=1e-3)  # nothing to lose: the policy reaches its bound
    assert sim.counts.get("aborted_stale", 0) == 0 and sim.trained_mix == {"t": 1.0}


def test_a_train_bound_eager_step_lasts_the_train_and_the_swap():
    """Rollout far faster than training (4k-token prompts trained on one GPU): eager α=4 steps at the trainer's pace,
    plus the swap between Trains (Get Batch waits for the last Train; the next starts after Update)."""
    t = task("t", reset_s=0.1, step_s=0.1)
    t["env_args"]["prompt_tokens"] = 4096
    cfg = flow([t], rollout={"mode": "rollart", "alpha": 4, "admission": "eager"}, emulation={"trainer": {"gpus": 1}})
    sim = run(cfg)
    model = MODELS["Qwen3-8B"]
    train = train_step_seconds(model, 1, 16 * 4097, GPUS["H800"])
    assert train > 5.0  # far beyond a trajectory's ~0.4 s
    assert sim.step_s == pytest.approx(train + weight_load_seconds(model, GPUS["H20"]), rel=1e-6)


@pytest.mark.parametrize("pull", ["background", "at_update"])
def test_a_train_bound_step_cannot_hide_the_weight_transfer(pull):
    """Train-bound, nothing to hide a transfer behind: a batch is ready as soon as a Train ends, and the next Train waits
    for the Update, which waits for the pull — in the background or at the Update alike: train + transfer + swap."""
    t = task("t", reset_s=0.1, step_s=0.1)
    t["env_args"]["prompt_tokens"] = 4096
    cfg = flow(
        [t],
        rollout={"mode": "rollart", "alpha": 4, "admission": "eager"},
        emulation={"trainer": {"gpus": 1}, "weight_link_gbps": 2.5},
        weights={"pull": pull},
    )
    model = MODELS["Qwen3-8B"]
    transfer = weight_transfer_seconds(model, 8, 1, 2.5, pull)  # one generation node (the H800 pool), one training node
    assert transfer == pytest.approx((2 if pull == "background" else 1) * model.weight_bytes / 2.5e9)  # put + get / one push
    train = train_step_seconds(model, 1, 16 * 4097, GPUS["H800"])
    assert run(cfg).step_s == pytest.approx(train + transfer + weight_load_seconds(model, GPUS["H20"]), rel=1e-6)


def test_eager_staleness_trains_less_of_the_slow_task_than_it_launches():
    """The bias the staleness policy must mend (issue tracker: fairness), in the policy itself: on the multi-task
    workload (three tasks launched alike) eager α=1 aborts and evicts stale work, and the slow task (swe, heavy-tailed
    resets) ends up at under half its launched share; safe admission aborts nothing and keeps it."""
    import yaml

    data = yaml.safe_load(open("flows/ablations/workloads/multitask.yaml").read())

    def swe_share(admission: str) -> tuple[float, float, int]:
        cfg = load_flow(
            data=data, overrides=["rollout.mode=rollart", "rollout.alpha=1", f"rollout.admission={admission}", "trainer.steps=12"]
        )
        runs = [run(cfg, seed=s) for s in range(3)]
        stale = sum(r.counts.get("aborted_stale", 0) + r.counts.get("evicted_stale", 0) for r in runs)
        return sum(r.trained_mix["swe"] for r in runs) / 3, sum(r.step_s for r in runs) / 3, stale, sum(r.held_mix["swe"] for r in runs) / 3

    eager, safe = swe_share("eager"), swe_share("safe")
    assert eager[2] > 0 and safe[2] == 0
    assert eager[0] < 0.5 * safe[0], (eager, safe)  # safe trains what it launched (~a quarter swe in this task sequence)
    assert eager[3] > safe[3] + 0.1  # while its groups hold more of the admission: relaunched members, evicted siblings
    assert eager[1] < safe[1]  # the speed bought with that bias


def test_the_simulated_mix_counts_the_steps_a_measurement_counts():
    """Compared with a run's trained mix (tools/ablation/measure.py: the steps after warm-up + 1), the simulated one counts
    the same steps (the warm-up steps' mix differs: the first batches hold what finished first)."""
    import yaml

    data = yaml.safe_load(open("flows/ablations/workloads/multitask.yaml").read())
    cfg = load_flow(data=data, overrides=["rollout.mode=rollart", "rollout.alpha=1", "rollout.admission=eager", "trainer.steps=6"])
    r = run(cfg, warmup=2, seed=0)

    def shares(steps):
        n = {t: sum(s.get(t, 0) for s in steps) for t in ("frozenlake", "math", "swe")}
        return {t: v / sum(n.values()) for t, v in n.items() if v}

    assert len(r.trained_by_step) == 6
    assert r.trained_mix == pytest.approx(shares(r.trained_by_step[3:]))
    assert r.trained_mix != pytest.approx(shares(r.trained_by_step))  # (the case tells the two apart)


def test_a_policy_that_can_never_train_is_an_error_not_a_hang():
    cfg = flow([task("t", reset_fail=1.0)], rollout={"mode": "rollart", "alpha": 1, "max_relaunch": 1})
    with pytest.raises(RuntimeError, match="made no step"):
        run(cfg, steps=2)


def test_an_emulated_engine_pulls_a_version_as_the_store_and_the_pull_mode_say(tmp_path):
    """The engine's side of the emulated transfer: 32 generation GPUs (4 nodes), 8 training GPUs (1 node), 25 GB/s —
    through the store 2 × bytes / link whatever the nodes; pushed at update, 4 copies through the one training link."""
    from rollart_dask.data.weights.store import WeightStore
    from rollart_dask.emulation.engine import EmulatedInstances

    for pull, copies in (("background", 2), ("at_update", 4)):
        cfg = flow(
            [task("t")],
            emulation={"weight_link_gbps": 25.0, "pools": {"H800": {"gpu": "H800", "gpus": 16}, "H20": {"gpu": "H20", "gpus": 16}}},
            weights={"pull": pull},
        )
        spec = {**WeightStore(cfg.weights, None, "trainer", tmp_path).spec(), "engine_pools": ["H20", "H800"]}
        engine = EmulatedInstances.from_config(cfg.engine, model_dir="", pool="H800", emulation=cfg.emulation)
        assert spec["pull"] == pull
        assert engine.emulated_pull_s(spec) == pytest.approx(copies * MODELS["Qwen3-8B"].weight_bytes / 25e9 * 0.05)
