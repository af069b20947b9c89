"""Advantage estimators (registry of small pure functions)."""
from __future__ import annotations

import math
from typing import Callable

ADVANTAGES: dict[str, Callable] = {}


def register_advantage(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn

    return deco


@register_advantage("grpo")
def grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """Group-normalised advantages: (r - mean) / (std + eps); a group without variance gives zeros.

    >>> grpo_advantages([1.0, 0.0, 1.0, 0.0])
    [0.999999, -0.999999, 0.999999, -0.999999]
    >>> grpo_advantages([1.0, 1.0])
    [0.0, 0.0]
    """
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    if std < eps:
        return [0.0] * n
    return [round((r - mean) / (std + eps), 6) for r in rewards]
