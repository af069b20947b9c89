"""Advantage estimators (registry of small pure functions), chosen by ``trainer.advantage``.

An estimator maps one group's rewards to one advantage per member: ``fn(rewards, scale=...) -> list[float]``
(``scale``: ``trainer.adv_scale``; ``advantage_fn`` binds it).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from rollart_dask.registry import Registry

ADVANTAGES = Registry("advantage")
register_advantage = ADVANTAGES.register  # @register_advantage("name")


def advantage_fn(name: str, scale: str = "std") -> Callable[[list[float]], list[float]]:
    """The estimator ``trainer.advantage`` with ``trainer.adv_scale`` bound: what build_samples takes."""
    return functools.partial(ADVANTAGES.get(name), scale=scale)


@register_advantage("grpo")
def grpo_advantages(rewards: list[float], eps: float = 1e-6, scale: str = "std") -> list[float]:
    """Group-relative advantages: scale std: (r - mean) / (std + eps), std the population one (÷ n); none: r - mean
    (Dr. GRPO: dividing by std weighs up groups of small variance, the too easy or too hard prompts). A group without
    variance gives zeros.

    >>> grpo_advantages([1.0, 0.0, 1.0, 0.0])
    [0.999998, -0.999998, 0.999998, -0.999998]
    >>> grpo_advantages([1.0, 0.0, 1.0, 0.0], scale="none")
    [0.5, -0.5, 0.5, -0.5]
    >>> grpo_advantages([1.0, 1.0])
    [0.0, 0.0]
    """
    if scale not in ("std", "none"):
        raise ValueError(f"trainer.adv_scale: {scale!r} is not one of std, none")
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    if std < eps:
        return [0.0] * n
    div = std + eps if scale == "std" else 1.0
    return [round((r - mean) / div, 6) for r in rewards]
