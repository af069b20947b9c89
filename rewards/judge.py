"""LLM-as-judge reward: an instruct model grades the agent's final answer Yes or No.

A stateful reward: it needs an inference engine, so it cannot be a stateless function call.
The module says so with ``NEEDS_ENGINE = True`` and splits into two pure, JSON-in/JSON-out parts
that the reward runner calls around one batched, greedy generation restricted to ``CHOICES``:

- ``request(trajectory) -> dict``: the judge's generate request (chat ``messages``, ``choices``,
  ``max_tokens``);
- ``reward(trajectory, completion) -> dict``: the score from the judge's completion
  (``{"text": ..., "logprobs": [...]}``, log-probabilities over the allowed choices).

What is graded: the task's question (the math env's ``info["entry"]["question"]``, else the
first observation), the agent's final answer (the last action) and, when the trajectory's info
carries one, a reference answer (``info["entry"]["answer"]`` from the math env, or
``info["reference"]`` from any env).

The score is the judge's probability of "Yes" against "No" at its verdict (the choices differ at
their first token, so the first-token distribution decides the verdict): the verdict is "Yes"
exactly when the score is at least 0.5. A completion that is not a verdict raises; no score is
ever made up. Nothing here imports the runtime.
"""

from __future__ import annotations

import math

NEEDS_ENGINE = True
CHOICES = ("Yes", "No")
MAX_TOKENS = 4
MAX_CHARS = 2000  # per graded field: a runaway answer does not blow up the judge's prompt
SYSTEM = "You grade answers. Reply Yes or No."


def _clip(text: str, keep_tail: bool = False) -> str:
    text = str(text).strip()
    if len(text) <= MAX_CHARS:
        return text
    return "…" + text[-MAX_CHARS:] if keep_tail else text[:MAX_CHARS] + "…"


def parts(trajectory: dict) -> tuple[str, str, str | None]:
    """(question, final answer, reference answer or None) of a finished trajectory."""
    turns = trajectory.get("turns") or []
    if not turns:
        raise ValueError("judge reward: the trajectory has no turns, so there is no answer to grade")
    info = trajectory.get("info") or {}
    entry = info.get("entry") if isinstance(info.get("entry"), dict) else {}
    question = entry.get("question") or turns[0].get("observation") or ""
    reference = entry.get("answer", info.get("reference"))
    return question, turns[-1].get("action") or "", None if reference is None else str(reference)


def judge_prompt(trajectory: dict) -> str:
    """The grading question put to the judge."""
    question, answer, reference = parts(trajectory)
    lines = [f"Question: {_clip(question)}"]
    if reference is not None:
        lines.append(f"Reference answer: {_clip(reference)}")
    lines.append(f"Given answer: {_clip(answer, keep_tail=True)}")
    lines.append("Is the given answer correct?" + (" Compare it with the reference answer." if reference is not None else ""))
    return "\n".join(lines)


def request(trajectory: dict) -> dict:
    """The judge's generate request: greedy, restricted to the verdict choices."""
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": judge_prompt(trajectory)}],
        "choices": list(CHOICES),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }


def score(verdict: str, logprob: float) -> dict:
    """The reward from the judge's verdict and the log-probability of that verdict among the choices."""
    verdict = str(verdict).strip()
    if verdict not in CHOICES:
        raise ValueError(f"judge reward: the judge answered {verdict!r}, not one of {list(CHOICES)}")
    logprob = float(logprob)
    if not math.isfinite(logprob) or logprob > 1e-6:
        raise ValueError(f"judge reward: log-probability {logprob} of the verdict is not a finite value <= 0")
    p = math.exp(min(logprob, 0.0))
    p_yes = p if verdict == "Yes" else 1.0 - p
    return {"score": round(p_yes, 6), "verdict": verdict, "success": verdict == "Yes"}


def reward(trajectory: dict, completion: dict) -> dict:
    logprobs = completion.get("logprobs") or []
    if not logprobs:
        raise ValueError(f"judge reward: the judge's completion has no log-probabilities ({completion.get('finish_reason')!r})")
    return score(completion.get("text", ""), logprobs[0])


def handler(event, context):
    raise RuntimeError("the judge reward needs an inference engine: it runs on the REWARD pool (reward runner), not as a Lambda function")
