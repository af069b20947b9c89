"""Math, GEM-Math-like: single-turn reasoning problems from reasoning-gym's offline generators.

Observation: the problem text (e.g. ``Calculate 5 - 3.``). Action: free text; the answer is
extracted tolerantly (``\\boxed{..}``, ``Answer: ..``, ``<answer>..</answer>``, else the last
number) and checked by the dataset's own verifier (``score_answer``). One step ends the
episode. Deterministic by seed: entry ``seed`` of the dataset built with ``dataset_seed``;
training seeds lie below 1_000_000 and held-out seeds at or above it. With small operands the
space of distinct problems is small, so held-out problems can repeat training ones.

``choices=[lo, hi]`` declares the answer grammar as the integers lo..hi (the env still parses
free text); an engine may then constrain decoding to it (``engine.constrained``).
"""

from __future__ import annotations

import functools
import json
import re

NUMBER = r"-?\d+(?:[.,]\d+)*(?:/\d+)?"


def extract_answer(text: str) -> str | None:
    """The answer in a response: boxed, tagged, after 'Answer:', else the last number."""
    for pattern in (r"\\boxed\{([^{}]*)\}", r"<answer>(.*?)</answer>", r"(?:final answer|answer)\s*(?:is)?\s*[:=]?\s*(" + NUMBER + ")"):
        found = re.findall(pattern, text, flags=re.IGNORECASE | re.DOTALL)
        if found:
            return found[-1].strip().rstrip(".")
    numbers = re.findall(NUMBER, text)
    return numbers[-1].replace(",", "") if numbers else None


BLOCK = 1000  # entries per cached dataset object: some generators precompute per-entry state at creation


@functools.lru_cache(maxsize=64)
def _dataset(name: str, args_json: str, block_seed: int):
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "the reasoning-gym tasks need the package 'reasoning_gym', which is not installed: pip install 'rollart-dask[envs]'"
        ) from e

    return reasoning_gym.create_dataset(name, seed=block_seed, size=BLOCK, **json.loads(args_json))


def get_entry(dataset: str, dataset_args: dict, dataset_seed: int, seed: int) -> dict:
    """Entry ``seed``: reasoning-gym draws entry i of a dataset seeded s from Random(s + i), so the
    block holding ``seed`` gives the same entry as one dataset of every seed would."""
    block = seed - seed % BLOCK
    return _dataset(dataset, json.dumps(dataset_args, sort_keys=True), dataset_seed + block)[seed - block]


def score(dataset: str, answer: str | None, entry: dict) -> float:
    """The dataset's own verifier."""
    import reasoning_gym

    return float(reasoning_gym.get_score_answer_fn(dataset)(answer, entry)) if answer is not None else 0.0


class MathEnv:
    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        dataset_args: dict | None = None,
        dataset_seed: int = 0,
        choices: list[int] | None = None,
        max_turns: int | None = None,
    ):
        self.dataset, self.dataset_args, self.dataset_seed = dataset, dict(dataset_args or {}), dataset_seed
        try:
            get_entry(dataset, self.dataset_args, dataset_seed, 0)
        except (ValueError, TypeError, AssertionError) as e:
            raise ValueError(f"math: dataset {dataset!r} with dataset_args {self.dataset_args}: {e}") from None
        if choices is not None:
            if len(choices) != 2 or choices[0] > choices[1]:
                raise ValueError(f"math: choices must be [lo, hi] with lo <= hi, got {choices}")
            self.action_choices = tuple(str(i) for i in range(int(choices[0]), int(choices[1]) + 1))
        self.entry: dict | None = None

    def reset(self, seed: int):
        e = get_entry(self.dataset, self.dataset_args, self.dataset_seed, seed)
        # Only JSON-able parts travel: the reward re-checks with the same verifier.
        self.entry = {
            "question": e["question"],
            "answer": str(e["answer"]),
            "metadata": json.loads(json.dumps(e.get("metadata", {}), default=str)),
        }
        return self.entry["question"], {"seed": seed, "dataset": self.dataset}

    def step(self, action: str):
        answer = extract_answer(action)
        s = score(self.dataset, answer, self.entry)  # type: ignore[arg-type]
        info = {
            "success": s >= 1.0,
            "score": s,
            "extracted": answer,
            "malformed": int(answer is None),
            "turns": 1,
            "valid": answer is not None,
            "dataset": self.dataset,
            "entry": self.entry,
        }
        return f"answer: {answer}" if answer is not None else "no answer found", s, True, False, info

    def expert_action(self) -> str | None:
        """The dataset's reference answer (demonstrations for a warm start)."""
        return None if self.entry is None else self.entry["answer"]

    def close(self):
        self.entry = None
