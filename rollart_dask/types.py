"""Plain data passed between the planes. No Dask, no torch: safe to import anywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One generate → env.step exchange of a trajectory."""

    observation: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per response token
    allowed_ids: list[list[int]] | None  # per response token: ids decoding was restricted to (None = full vocab)
    version: int  # policy version of the engine that produced this turn (its last token, when continued)
    action: str = ""
    env_reward: float = 0.0
    token_versions: list[int] | None = None  # per response token, when the turn was continued across versions (else all `version`)
    messages: Any = None  # the chat messages the model saw ((role, content) pairs, or one user message's text): prompt_ids templated


@dataclass
class Trajectory:
    id: str
    group_id: str
    task: str
    seed: int
    turns: list[Turn] = field(default_factory=list)
    version: int | None = None  # engine version at the first generate
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    finished_version: int | None = None  # engine version when it finished: its in-flight lag is this − version
    finished_at: float | None = None  # monotonic time it finished: how long it then waited for the Train that used it
    sampling_seed: int | None = None  # rollout.deterministic: its tokens' seeds derive from this (algo/seeding.py)

    @property
    def success(self) -> bool:
        """The reward's own success flag when it gives one, else a positive score."""
        return bool(self.info.get("reward", {}).get("success", (self.reward or 0) > 0))

    def for_reward(self) -> dict[str, Any]:
        """The JSON-serialisable view a reward function receives."""
        return {
            "task": self.task,
            "seed": self.seed,
            "turns": [{"observation": t.observation, "action": t.action, "env_reward": t.env_reward} for t in self.turns],
            "info": self.info,
        }


@dataclass
class Completion:
    """What an engine returns for one generate request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    allowed_ids: list[list[int]] | None
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    version: int
    token_versions: list[int] | None = None  # per token, when continued from a prefix made at other versions
