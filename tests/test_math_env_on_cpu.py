"""Math env (reasoning-gym generators, their own verifiers) and its reward."""

import pytest

from rollart_dask.envs.reasoning import MathEnv, extract_answer
from rollart_dask.rewards.reasoning import handler, reward

EASY = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{42}", "42"),
        ("so the result is \\boxed{-7}.", "-7"),
        ("Answer: 13", "13"),
        ("The final answer is 8.", "8"),
        ("<answer>5</answer>", "5"),
        ("3 plus 4 makes 7", "7"),
        ("1,234", "1234"),
        ("no number here", None),
        ("", None),
    ],
)
def test_answer_extraction_is_tolerant_of_the_usual_formats(text, expected):
    assert extract_answer(text) == expected


def play(env, seed, action):
    q, _ = env.reset(seed)
    obs, r, term, trunc, info = env.step(action)
    return {"task": "math", "seed": seed, "turns": [{"observation": q, "action": action, "env_reward": r}], "info": info}, r, term


def test_deterministic_by_seed_and_checked_by_the_dataset_verifier():
    env = MathEnv(dataset_args=EASY, choices=[-10, 20])
    q1, _ = env.reset(7)
    a1 = env.entry["answer"]
    q2, _ = MathEnv(dataset_args=EASY).reset(7)
    assert q1 == q2 and q1.startswith("Calculate")
    assert len({MathEnv(dataset_args=EASY).reset(s)[0] for s in range(1_000_000, 1_000_050)}) > 20  # held-out seeds vary
    assert set(env.action_choices) == {str(i) for i in range(-10, 21)} and a1 in env.action_choices
    traj, r, term = play(env, 7, a1)
    assert term and r == 1.0 and traj["info"]["success"]
    assert reward(traj) == {"score": 1.0, "success": True, "answer": a1}
    assert handler(traj, None) == reward(traj)  # the same function as a Lambda handler
    wrong = str(int(a1) + 1)
    traj, r, _ = play(env, 7, f"The answer is {wrong}")
    assert r == 0.0 and reward(traj)["score"] == 0.0 and not reward(traj)["success"]
    traj, r, _ = play(env, 7, "I do not know")
    assert traj["info"]["malformed"] == 1 and reward(traj)["score"] == pytest.approx(-0.1)


def test_gsm_symbolic_free_text_and_bad_configs():
    env = MathEnv(dataset="gsm_symbolic")
    q, _ = env.reset(3)
    assert len(q) > 50
    traj, r, _ = play(env, 3, f"Step by step... \\boxed{{{env.entry['answer']}}}")
    assert r == 1.0 and reward(traj)["success"]
    with pytest.raises(ValueError, match="no_such_dataset"):
        MathEnv(dataset="no_such_dataset")
    with pytest.raises(ValueError, match="choices"):
        MathEnv(dataset_args=EASY, choices=[5, 1])
    with pytest.raises(ValueError, match="entry"):
        reward({"task": "math", "turns": [{"action": "1"}], "info": {}})
