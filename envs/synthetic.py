"""EMULATED agentic workload: an env whose only content is the *shape* of a task — turns, prompt,
observation and response lengths, success rate, reward cost — for system ablations on the
emulated engine. Nothing here is a real task; every info says ``emulated``.

Each turn's info carries ``emulate = {"prompt_tokens", "output_tokens"}`` for the next generate:
the prompt is the whole conversation so far (first prompt + every response and observation), so
the engine's prefix cache sees what a real multi-turn chat gives it. Latency of reset/step is not
here: wrap the task with ``inject`` (envs/inject.py), which the flow's ``tasks.*.inject`` does.

Lengths are an int (constant) or ``{median, sigma, min, max}``: a lognormal with that median and
log-space ``sigma``, clipped to [min, max]. Prompt lengths depend on the episode seed only (group
members share a prompt); response and observation lengths are drawn per env instance.
"""

from __future__ import annotations

import math
import random
import zlib
from typing import Any


def draw_length(spec: int | dict, rng: random.Random, minimum: int = 1) -> int:
    """One token length from a spec: an int (fixed) or a clipped lognormal {median, sigma, min, max}."""
    if isinstance(spec, (int, float)):
        return max(minimum, int(spec))
    unknown = set(spec) - {"median", "sigma", "min", "max"}
    if unknown or "median" not in spec:
        raise ValueError(f"length spec {spec!r}: give an int or {{median, sigma, min, max}} (unknown: {sorted(unknown)})")
    x = float(spec["median"]) * math.exp(float(spec.get("sigma", 0.0)) * rng.gauss(0.0, 1.0))
    return int(min(max(x, spec.get("min", minimum)), spec.get("max", math.inf)))


def length_mean(spec: int | dict, samples: int = 20000, minimum: int = 1) -> float:
    """Mean of a length spec (Monte Carlo for clipped lognormals), for the ideal calculator."""
    if isinstance(spec, (int, float)):
        return float(max(minimum, int(spec)))
    rng = random.Random(0)
    return sum(draw_length(spec, rng, minimum) for _ in range(samples)) / samples


class SyntheticAgentEnv:
    """``turns`` generate → step exchanges, then success with probability ``success_p`` (reward 1).
    ``reward_s``: EMULATED seconds the reward takes for this trajectory (rewards/emulated.py sleeps
    ``reward_s × time_scale``; the flow fills ``time_scale`` from ``emulation.time_scale``)."""

    emulated = True

    def __init__(
        self,
        turns: int = 1,
        prompt_tokens: Any = 512,
        output_tokens: Any = 256,
        obs_tokens: Any = 64,
        success_p: float = 0.5,
        reward_s: float = 0.0,
        time_scale: float = 1.0,
        name: str = "synthetic",
    ):
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        if not 0 <= success_p <= 1:
            raise ValueError(f"success_p must be in [0, 1], got {success_p}")
        self.turns, self.success_p, self.name = int(turns), float(success_p), name
        self.spec = {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "obs_tokens": obs_tokens}
        for v in self.spec.values():
            draw_length(v, random.Random(0))  # a bad spec fails at construction, naming itself
        self.reward_s, self.time_scale = float(reward_s), float(time_scale)
        self._rng = random.Random(0)  # reset draws its own; an unseeded Random reads the OS entropy pool (slow, per env)
        self._turn = 0
        self._context = 0
        self._seed = 0

    def _next(self) -> dict:
        out = draw_length(self.spec["output_tokens"], self._rng)
        return {"prompt_tokens": self._context, "output_tokens": out}

    def reset(self, seed: int | None = None):
        self._seed = int(seed or 0)
        self._rng = random.Random(zlib.crc32(f"{self.name}:{self._seed}:{random.random()}".encode()))
        self._turn = 0
        self._context = draw_length(self.spec["prompt_tokens"], random.Random(zlib.crc32(f"{self.name}:{self._seed}".encode())))
        self._hint = self._next()
        return f"[emulated {self.name} seed {self._seed}] turn 0", {"emulate": self._hint, "emulated": True}

    def step(self, action: str):
        self._turn += 1
        self._context += self._hint["output_tokens"]
        if self._turn >= self.turns:
            success = self._rng.random() < self.success_p
            info = {"emulated": True, "success": success, "return": float(success), "reward_s": self.reward_s * self.time_scale}
            return f"[emulated {self.name}] done", float(success), True, False, info
        self._context += draw_length(self.spec["obs_tokens"], self._rng, minimum=0)
        self._hint = self._next()
        return f"[emulated {self.name}] turn {self._turn}", 0.0, False, False, {"emulate": self._hint, "emulated": True}

    def close(self):
        pass
