"""Reward runner on the SERVERLESS pool: calls a reward function on a finished trajectory."""
from __future__ import annotations

import time

from ..registry import get_reward


class RewardRunner:
    def __init__(self):
        self.stats = {"calls": 0, "busy_s": 0.0}

    def score(self, item: dict) -> dict:
        t0 = time.perf_counter()
        out = get_reward(item["reward"])(item["trajectory"])
        if isinstance(out, (int, float)):
            out = {"score": float(out)}
        if not isinstance(out, dict) or not isinstance(out.get("score"), (int, float)):
            raise TypeError(f"reward {item['reward']!r} returned {out!r}; expected a float or a dict with a numeric 'score'")
        self.stats["calls"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        return out
