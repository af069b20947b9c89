"""What a reward function may return: a finite number, or a dict with a finite numeric ``score`` (and any other
JSON-able fields). Anything else is the user's function failing, never a value to train on: a NaN score would
make every advantage of its group NaN and, past the gradient clip, the weights. The same check runs wherever a
reward is scored (in-process, the judge, a Lambda invocation's response)."""

from __future__ import annotations

import math

from rollart_dask.usercode import UserFunctionError

ALLOWED = "a finite number, or a dict with a finite numeric 'score'"


class RewardValueError(UserFunctionError):
    """A reward function returned something that is not a score; the message names the function and the value."""


def reward_value(name: str, out) -> dict:
    """``out`` as a result dict whose ``score`` is a finite float, or RewardValueError."""
    score = out.get("score") if isinstance(out, dict) else out
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        what = (
            f"a dict without 'score' (keys {sorted(out)[:8]})"
            if isinstance(out, dict) and "score" not in out
            else f"score {_short(score)} ({type(score).__name__})"
        )
        raise RewardValueError(f"reward {name!r} returned {what}; a reward returns {ALLOWED}")
    if not math.isfinite(score):
        raise RewardValueError(f"reward {name!r} returned score {score}; a reward returns {ALLOWED}")
    return dict(out, score=float(score)) if isinstance(out, dict) else {"score": float(score)}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
