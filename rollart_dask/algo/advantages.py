"""Advantage estimators (registry of small pure functions), chosen by ``trainer.advantage``.

An estimator maps one group's rewards to one advantage per member: ``fn(rewards) -> list[float]``.
"""
from __future__ import annotations

import math

from rollart_dask.registries import Registry

ADVANTAGES = Registry("advantage")
register_advantage = ADVANTAGES.register  # @register_advantage("name")


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
