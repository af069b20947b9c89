"""Env host: many env instances in one worker, keyed by trajectory id.

env.step runs where its env lives: the control plane routes every call of a trajectory
to the worker that reset it. An env is closed when its episode ends.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from envs.inject import Injected, parse_spec

from rollart_dask.registry import make_env


@functools.lru_cache(maxsize=64)
def _spec(spec_json: str):
    return parse_spec(json.loads(spec_json))  # validated once per worker, not per reset


class EnvHost:
    def __init__(self, threads: int = 64):
        self.envs: dict[str, object] = {}
        self.stats = {"resets": 0, "steps": 0, "busy_s": 0.0, "resets_s": 0.0, "steps_s": 0.0}
        # Every call on its own thread: envs wait on containers, networks and sandboxes far more than
        # they compute, and one slow env.step must not delay any other (see dispatch.py, streamed calls).
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="envhost")
        self._lock = threading.Lock()

    def _count(self, kind: str, t0: float) -> None:
        with self._lock:  # calls of a batch finish on several threads
            dt = time.perf_counter() - t0
            self.stats[kind] += 1
            self.stats[f"{kind}_s"] += dt
            self.stats["busy_s"] += dt  # env-seconds: over 1 per wall second when calls overlap

    def reset(self, item: dict) -> tuple[str, dict]:
        t0 = time.perf_counter()
        self.close(item["traj_id"])
        env = make_env(item["env"], **item.get("env_args", {}))
        if item.get("inject"):  # EMULATED latency/failures for ablations; draws keyed by member and attempt
            env = Injected(env, _spec(json.dumps(item["inject"], sort_keys=True)))
            obs, info = env.reset(seed=item["seed"], stream=f"{item.get('member', 0)}.{item.get('attempt', 0)}")
        else:
            obs, info = env.reset(seed=item["seed"])
        self.envs[item["traj_id"]] = env
        info = dict(info)
        info["action_choices"] = list(getattr(env, "action_choices", None) or [])
        self._count("resets", t0)
        return obs, info

    def step(self, item: dict) -> tuple[str, float, bool, bool, dict]:
        t0 = time.perf_counter()
        env = self.envs.get(item["traj_id"])
        if env is None:
            raise KeyError(f"no env for trajectory {item['traj_id']} on this worker (lost with a restart?)")
        obs, reward, terminated, truncated, info = env.step(item["action"])
        if terminated or truncated or item.get("last"):
            self.close(item["traj_id"])
        self._count("steps", t0)
        return obs, float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self, traj_id: str) -> None:
        env = self.envs.pop(traj_id, None)
        if env is not None:
            env.close()


def expert_demos(item: dict) -> list[dict]:
    """Play an env's expert on the given seeds (the warm start's demonstrations). Each turn is a
    dict {task, prompt, action, choices, max_tokens}; an episode the expert cannot finish
    (no expert action, or out of turns) contributes the turns it played."""
    env = make_env(item["env"], **item.get("env_args", {}))
    if not callable(getattr(env, "expert_action", None)):
        raise TypeError(f"env {item['env']!r} (task {item['task']}) has no expert_action(): it cannot give warm-start demonstrations")
    demos = []
    try:
        for seed in item["seeds"]:
            obs, _ = env.reset(seed=seed)
            choices = list(getattr(env, "action_choices", None) or [])
            for _ in range(item["max_turns"]):
                action = env.expert_action()
                if action is None:
                    break
                demos.append({"task": item["task"], "prompt": obs, "action": action, "choices": choices, "max_tokens": item["max_tokens"]})
                obs, _, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    break
    finally:
        env.close()
    return demos
