"""Warm start: experts in the envs, demonstrations encoded exactly as the engine decodes, and
imitation that moves the policy (no cluster)."""

import pytest

from rollart_dask.envs.code_sandbox import CodeSandboxEnv
from rollart_dask.envs.frozenlake import FrozenLakeText
from rollart_dask.envs.reasoning import MathEnv
from rollart_dask.envs.sokoban import SokobanText
from rollart_dask.config import FlowError, load_flow
from rollart_dask.data.encoding import demo_sample
from rollart_dask.data.engine_torch import TorchEngine
from rollart_dask.data.envhost import expert_demos
from rollart_dask.data.trainer_torch import TorchTrainer
from tests.conftest import flow_dict

MATH_ARGS = {
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
}


@pytest.mark.parametrize("env", [FrozenLakeText(size=4), SokobanText()], ids=["frozenlake", "sokoban"])
def test_following_the_expert_solves_every_level(env):
    for seed in range(40):
        env.reset(seed)
        for _ in range(30):
            action = env.expert_action()
            if action is None:
                break
            _, _, terminated, _, info = env.step(action)
            if terminated:
                break
        assert env.success, f"seed {seed}: the expert did not reach the goal"


def test_math_and_code_experts_score_full_marks():
    math = MathEnv(**MATH_ARGS)
    for seed in range(20):
        math.reset(seed)
        assert math.step(math.expert_action())[1] == 1.0
    code = CodeSandboxEnv(backend="subprocess", max_turns=2)
    try:
        for seed in range(3):
            code.reset(seed)
            _, reward, terminated, _, info = code.step(code.expert_action())
            assert reward == 1.0 and terminated, info
            assert code.expert_action() is None  # solved: nothing left to demonstrate
    finally:
        code.close()


def test_demonstrations_encode_exactly_as_the_engine_decodes(model_dir):
    """Whatever the engine emits for a choice (prefix choices end with EOS, others do not),
    demo_sample reproduces its prompt ids, response ids and allowed ids."""
    engine = TorchEngine(str(model_dir))
    env = MathEnv(**MATH_ARGS)
    choices = list(env.action_choices)
    prompts = [env.reset(s)[0] for s in range(40)]
    reqs = [{"id": str(i), "prompt": p, "choices": choices, "max_tokens": 4, "temperature": 1.0} for i, p in enumerate(prompts)]
    emitted = set()
    for c, p in zip(engine.generate(reqs), prompts):
        d = demo_sample(engine.tokenizer, p, c.text, choices, max_tokens=4)
        assert (d["prompt_ids"], d["response_ids"], d["allowed_ids"]) == (list(c.prompt_ids), c.token_ids, c.allowed_ids)
        emitted.add(len(c.token_ids))
    assert len(emitted) > 1  # one- and multi-token answers were both covered
    assert demo_sample(engine.tokenizer, prompts[0], "99", choices, max_tokens=4) is None  # not a choice
    assert demo_sample(engine.tokenizer, prompts[0], "1", choices, max_tokens=1) is None  # "1" prefixes "12": 1, EOS is over budget
    assert len(demo_sample(engine.tokenizer, prompts[0], "1", choices, max_tokens=2)["response_ids"]) == 2
    free = demo_sample(engine.tokenizer, prompts[0], "7", None, max_tokens=4)
    assert free["response_ids"][-1] == engine.tokenizer.eos_token_id and free["allowed_ids"] is None


def test_imitation_moves_greedy_play_toward_the_expert(model_dir):
    demos = expert_demos(
        {"task": "frozenlake", "env": "frozenlake", "env_args": {"size": 4}, "max_turns": 8, "max_tokens": 2, "seeds": list(range(300))}
    )
    assert demos and {d["task"] for d in demos} == {"frozenlake"}
    engine, trainer = TorchEngine(str(model_dir)), TorchTrainer(str(model_dir), lr=3e-4)
    held_out = [
        d
        for d in expert_demos(
            {
                "task": "frozenlake",
                "env": "frozenlake",
                "env_args": {"size": 4},
                "max_turns": 8,
                "max_tokens": 2,
                "seeds": list(range(10**6, 10**6 + 100)),
            }
        )
    ]

    def agreement():
        reqs = [
            {"id": str(i), "prompt": d["prompt"], "choices": d["choices"], "max_tokens": 2, "temperature": 0}
            for i, d in enumerate(held_out)
        ]
        return sum(c.text == d["action"] for c, d in zip(engine.generate(reqs), held_out)) / len(held_out)

    before = agreement()
    m = trainer.warm_start(demos, steps=150, batch_size=64, lr=3e-3)
    engine.update_weights(m["version"], trainer.state_dict())
    after = agreement()
    assert m["version"] == 1 and m["samples"] == len(demos) and m["skipped"] == 0
    assert m["nll_last"] < m["nll_first"]
    assert after > before + 0.2, (before, after)
    assert trainer.opt.param_groups[0]["lr"] == 3e-4  # RL starts with a fresh optimizer at its own lr


def test_warm_start_config_names_unknown_tasks():
    with pytest.raises(FlowError, match="warmstart.tasks.*nope"):
        load_flow(data=flow_dict(**{"warmstart.steps": 5, "warmstart.tasks": {"nope": 1.0}}))
    with pytest.raises(FlowError, match="share > 0"):
        load_flow(data=flow_dict(**{"warmstart.steps": 5, "warmstart.tasks": {"frozenlake": 0}}))
    with pytest.raises(TypeError, match="no expert_action"):
        expert_demos({"task": "g", "env": "gym", "env_args": {"env_id": "FrozenLake-v1"}, "max_turns": 2, "max_tokens": 2, "seeds": [0]})
