"""Training samples from finished groups: a pure function beside the algorithms (no Dask, no torch).

One sample per turn (prompt ids, response ids, behaviour log-probs, allowed ids, the policy version of the turn
and, when it was continued across versions, of each response token; the trajectory's advantage); the stats
describe the batch as trained: reward, success, the share of groups with any signal (a group whose members all
scored alike teaches nothing under GRPO), the share of turns continued across versions, and per task; ``sha256`` (asked
for: rollout.deterministic): the batch as trained, in order (runs that train the same samples in the same order print the
same one).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Callable, Protocol, Sequence

from rollart_dask.types import Trajectory


class FinishedGroup(Protocol):
    task: str
    kept: list[Trajectory]


def build_samples(
    groups: Sequence[FinishedGroup], advantage: Callable[[list[float]], list[float]], digest: bool = False
) -> tuple[list[dict], dict]:
    """(samples, stats) for a batch of groups, with ``advantage(rewards) -> one value per member``; ``digest``: the stats
    carry ``sha256`` too."""
    samples: list[dict] = []
    rewards: list[float] = []
    success: list[float] = []
    varied = 0
    per_task: dict[str, dict] = {}
    for g in groups:
        rs = [t.reward for t in g.kept]
        advs = advantage(rs)
        varied += int(any(a != 0 for a in advs))
        rewards += rs
        pt = per_task.setdefault(g.task, {"groups": 0, "trajectories": 0, "reward_sum": 0.0, "success_sum": 0.0, "turns": 0})
        pt["groups"] += 1
        for traj, a in zip(g.kept, advs):
            success.append(float(traj.success))
            pt["trajectories"] += 1
            pt["reward_sum"] += traj.reward
            pt["success_sum"] += float(traj.success)
            pt["turns"] += len(traj.turns)
            for turn in traj.turns:
                samples.append(
                    {
                        "prompt_ids": turn.prompt_ids,
                        "response_ids": turn.response_ids,
                        "logprobs": turn.logprobs,
                        "allowed_ids": turn.allowed_ids,
                        "version": turn.version,
                        "token_versions": turn.token_versions,
                        "advantage": a,
                    }
                )
    mixed = sum(len(set(s["token_versions"] or ())) > 1 for s in samples)
    stats = {
        "trajectories": len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "success": sum(success) / len(success),
        "mixed_version_turns": mixed / len(samples),
        "groups_with_signal": varied / len(groups),
        "turns_per_traj": len(samples) / len(rewards),
        "tasks": {
            name: {
                "groups": pt["groups"],
                "trajectories": pt["trajectories"],
                "reward_mean": pt["reward_sum"] / pt["trajectories"],
                "success": pt["success_sum"] / pt["trajectories"],
                "turns_per_traj": pt["turns"] / pt["trajectories"],
            }
            for name, pt in per_task.items()
        },
    }
    if digest:
        stats["sha256"] = batch_digest(samples)
    return samples, stats


def batch_digest(samples: Sequence[dict]) -> str:
    """What the trainer is given, in order, hashed (16 hex digits): every sample's tokens, behaviour log-probs (exact:
    a float's repr round-trips), versions and advantage."""
    h = hashlib.sha256()
    for s in samples:
        h.update(
            json.dumps(
                [list(s["prompt_ids"]), list(s["response_ids"]), s["logprobs"], s["version"], s["token_versions"], s["advantage"]]
            ).encode()
        )
    return h.hexdigest()[:16]


def version_lag(samples: Sequence[dict], trainer_version: int) -> dict:
    """How far behind the trainer each response token's policy is (trainer version − token version), over the batch's
    tokens: mean, max, and the share of tokens made by an older version than the trainer's."""
    lag: Counter = Counter()  # lag → tokens
    for s in samples:
        if s.get("token_versions") is not None:
            lag.update(trainer_version - v for v in s["token_versions"])
        elif "version" in s:
            lag[trainer_version - s["version"]] += len(s["response_ids"])
    n = sum(lag.values())
    if not n:
        return {}
    return {
        "token_lag_mean": sum(k * v for k, v in lag.items()) / n,
        "token_lag_max": max(lag),
        "token_lag_share": sum(v for k, v in lag.items() if k > 0) / n,
    }


def within_lag(samples: Sequence[dict], trainer_version: int, bound: int) -> tuple[list[dict], int]:
    """The samples none of whose tokens is more than ``bound`` versions behind the trainer (rollout.max_trained_lag),
    and how many others there were."""

    def oldest(s: dict) -> int:
        return min(s["token_versions"]) if s.get("token_versions") else s.get("version", trainer_version)

    kept = [s for s in samples if trainer_version - oldest(s) <= bound]
    return kept, len(samples) - len(kept)
