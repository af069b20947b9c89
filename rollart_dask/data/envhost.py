"""Env host: many env instances in one worker, keyed by trajectory id.

env.step runs where its env lives: the control plane routes every call of a trajectory
to the worker that reset it. An env is closed when its episode ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from rollart_dask.envs.inject import Injected, InjectedFailure, parse_spec

from rollart_dask.config import PromptConfig
from rollart_dask.models.prompts import Conversation
from rollart_dask.registry import make_env
from rollart_dask.usercode import UserFunctionError, user_error


@functools.lru_cache(maxsize=64)
def _spec(spec_json: str):
    return parse_spec(json.loads(spec_json))  # validated once per worker, not per reset


class Superseded(RuntimeError):
    """A reset attempt that a later attempt (a retry after a timeout) or a close overtook: its env is closed."""


class EnvHost:
    """Calls of one trajectory may overlap on the host: a reset retried after a timeout runs beside the
    attempt that timed out, and a close (the trajectory was cancelled) can come during a step. So the
    latest reset attempt wins and an overtaken one closes the env it made (none leaks, and the env
    kept is the one whose observation the control plane got); steps and closes of a trajectory take
    turns; a reset that comes after its trajectory's close is refused."""

    def __init__(self, threads: int = 512):
        self.envs: dict[str, object] = {}
        self.stats = {
            "resets": 0,
            "steps": 0,
            "busy_s": 0.0,
            "resets_s": 0.0,
            "steps_s": 0.0,
            "superseded": 0,
            "envs_made": 0,
            "envs_closed": 0,
        }
        self._live: set[int] = set()  # id() of every env made and not yet closed: each is closed exactly once
        self._resetting: dict[str, list] = {}  # trajectory → the envs its reset attempts in progress are making
        # Every slow call on its own thread: envs wait on containers, networks and sandboxes far more than
        # they compute, and one slow env.step must not delay any other (see dispatch.py, streamed calls).
        # Enough threads for every env a worker holds to wait at once (eager α=4 puts 160 on each of two
        # workers in the multi-task ablation; at 64 a reset queued ~40 ms behind sleeping ones): a waiting
        # thread costs no CPU, and fast calls never come here (data/tasks.py, Speed).
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="envhost")
        self._lock = threading.Lock()
        self._attempt: OrderedDict[str, int] = OrderedDict()  # trajectory → its latest reset attempt (recent ones)
        self._turns: dict[str, list] = {}  # trajectory → [lock, holders]: its step and close take turns
        self._closed: OrderedDict[str, None] = OrderedDict()  # trajectories closed by the control plane (recent ones)

    def _count(self, kind: str, t0: float, done: bool = True) -> None:
        """A call's time inside the host, failed ones too (the caller waited for them as well); ``kind`` counts the done."""
        with self._lock:  # calls of a batch finish on several threads
            dt = time.perf_counter() - t0
            self.stats[kind] += done
            self.stats[f"{kind}_s"] += dt
            self.stats["busy_s"] += dt  # env-seconds: over 1 per wall second when calls overlap

    @contextmanager
    def _turn(self, traj_id: str, wait_s: float = -1):
        """The trajectory's turn: its calls one at a time. ``wait_s`` ≥ 0: go ahead anyway after that long (a close
        must not wait for a call that hangs; closing the env is what ends it)."""
        with self._lock:
            entry = self._turns.setdefault(traj_id, [threading.Lock(), 0])
            entry[1] += 1
        got = entry[0].acquire(timeout=wait_s)
        try:
            yield
        finally:
            if got:
                entry[0].release()
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._turns[traj_id]

    def reset(self, item: dict) -> tuple[str, dict]:
        t0 = time.perf_counter()
        tid, attempt = item["traj_id"], int(item.get("attempt", 0))
        with self._lock:
            if tid in self._closed:
                raise Superseded(f"trajectory {tid} was closed: reset attempt {attempt} refused")
            if attempt < self._attempt.get(tid, -1):
                raise Superseded(f"reset attempt {attempt} of {tid} came after attempt {self._attempt[tid]}")
            remember(self._attempt, tid, attempt)  # kept after the episode: a late earlier attempt is still refused
        env = self._make(item)
        with self._lock:  # an earlier attempt still in progress (hung: this one is its retry) is overtaken: end it now
            overtaken, self._resetting[tid] = self._resetting.get(tid, []), [env]
        for old in overtaken:
            self._close(old)
        try:
            if item.get("inject"):  # EMULATED latency/failures for ablations; draws keyed by member and attempt
                obs, info = _user_call(env, "reset", seed=item["seed"], stream=f"{item.get('member', 0)}.{attempt}")
            else:
                obs, info = _user_call(env, "reset", seed=item["seed"])
            info = dict(info)
            _check_observation(env, "reset", obs)
            info["action_choices"] = list(getattr(env, "action_choices", None) or [])
        except BaseException:
            self._close(env)
            self._count("resets", t0, done=False)
            raise
        finally:
            with self._lock:
                if env in self._resetting.get(tid, ()):
                    self._resetting[tid].remove(env)
                    if not self._resetting[tid]:
                        del self._resetting[tid]
        with self._lock:
            current = self._attempt.get(tid) == attempt and tid not in self._closed
            if current:  # kept; an earlier attempt's env, if any, is closed instead
                env, self.envs[tid] = self.envs.get(tid), env
            else:
                self.stats["superseded"] += 1
        if env is not None:
            self._close(env)
        if not current:
            raise Superseded(f"reset attempt {attempt} of {tid} was overtaken by a later attempt or a close")
        self._count("resets", t0)
        return obs, info

    def kind(self, traj_id: str) -> str:
        """What kind of env a trajectory's is (its class), for timing its steps apart from other kinds'."""
        return type(self.envs.get(traj_id)).__name__

    def step(self, item: dict) -> tuple[str, float, bool, bool, dict]:
        t0 = time.perf_counter()
        tid = item["traj_id"]
        with self._turn(tid):
            env = self.envs.get(tid)
            if env is None:
                raise KeyError(f"no env for trajectory {tid} on this worker (closed, or lost with a restart?)")
            try:
                obs, reward, terminated, truncated, info = _user_call(env, "step", item["action"])
                _check_observation(env, "step", obs)
            except BaseException:
                self._count("steps", t0, done=False)
                raise
            if terminated or truncated or item.get("last"):
                self._drop(tid)
        self._count("steps", t0)
        return obs, float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self, traj_id: str, hung_after_s: float = 5.0) -> None:
        """The control plane is done with this trajectory (cancelled or failed): after any step in progress (one
        still running after ``hung_after_s`` is hung: closing its env ends it), its env is closed; a reset attempt
        still running has its env closed now, one yet to come closes its own."""
        with self._lock:
            remember(self._closed, traj_id, None)  # at once: a reset finishing meanwhile sees it
            resetting = self._resetting.pop(traj_id, [])
        for env in resetting:
            self._close(env)
        with self._turn(traj_id, wait_s=hung_after_s):
            self._drop(traj_id)

    def _drop(self, traj_id: str) -> None:
        with self._lock:
            env = self.envs.pop(traj_id, None)
        if env is not None:
            self._close(env)

    def _make(self, item: dict):
        env = _user_env(item)
        if item.get("inject"):  # EMULATED latency/failures for ablations (its close closes the env it wraps)
            env = Injected(env, _spec(json.dumps(item["inject"], sort_keys=True)))
        with self._lock:
            self._live.add(id(env))
            self.stats["envs_made"] += 1
        return env

    def _close(self, env) -> None:
        """Every env is closed here, exactly once (several paths may end one env: a close, its hung reset waking)."""
        with self._lock:
            key = id(env)
            if key not in self._live:
                return
            self._live.discard(key)
            self.stats["envs_closed"] += 1
        env.close()

    def open_envs(self) -> int:
        """Envs made and not closed yet (0 once every trajectory it hosted has ended)."""
        with self._lock:
            return len(self._live)


def remember(recent: OrderedDict, key, value, keep: int = 65536) -> None:
    """Record ``key`` in a bounded map of recent trajectories (the oldest, long over, are forgotten)."""
    recent[key] = value
    recent.move_to_end(key)
    while len(recent) > keep:
        recent.popitem(last=False)


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
            chat = Conversation(PromptConfig(**item.get("prompt", {})), item["max_turns"])  # the messages RL's turns will see
            choices = list(getattr(env, "action_choices", None) or [])
            for _ in range(item["max_turns"]):
                action = env.expert_action()
                if action is None:
                    break
                demos.append(
                    {"task": item["task"], "prompt": chat.ask(obs), "action": action, "choices": choices, "max_tokens": item["max_tokens"]}
                )
                chat.answered(action)
                obs, _, terminated, truncated, _ = env.step(action)
                if terminated or truncated:
                    break
    finally:
        env.close()
    return demos


def preflight_episode(item: dict) -> dict:
    """One episode of a task's env before the run generates anything: made, reset, stepped with its expert's action
    (else its first allowed action, else a plain answer) to its end or max_turns. Its turns and final info, for the
    reward to be called on; what the user's env does wrong raises UserFunctionError, named."""
    env = _user_env(item)
    turns, info, terminated = [], {}, False
    try:
        obs, info = _user_call(env, "reset", seed=item["seed"])
        _check_observation(env, "reset", obs)
        choices = list(getattr(env, "action_choices", None) or [])
        for _ in range(item["max_turns"]):
            expert = getattr(env, "expert_action", None)
            action = (expert() if callable(expert) else None) or (choices[0] if choices else "0")
            nobs, reward, terminated, truncated, info = _user_call(env, "step", action)
            _check_observation(env, "step", nobs)
            turns.append({"observation": obs, "action": action, "env_reward": float(reward)})
            obs = nobs
            if terminated or truncated:
                break
    finally:
        with contextlib.suppress(Exception):
            env.close()
    return {"turns": turns, "info": dict(info, truncated=not terminated)}


def _user_env(item: dict):
    """The task's env made; what the user's constructor (or an unknown name) raises comes back as theirs, named."""
    try:
        return make_env(item["env"], **item.get("env_args", {}))
    except Exception as e:
        raise user_error(f"env {item['env']!r} with env_args {item.get('env_args', {})}", e) from e


def _user_call(env, call: str, *args, **kwargs):
    """``env.<call>(...)``; what the user's env raises comes back as theirs, named (EMULATED injected faults stand for a
    flaky env service, not the user's code: they pass as they are)."""
    try:
        return getattr(env, call)(*args, **kwargs)
    except InjectedFailure:
        raise
    except Exception as e:
        raise user_error(f"{_name(env)}.{call}", e) from e


def _name(env) -> str:
    inner = getattr(env, "env", None) if type(env).__name__ == "Injected" else None  # (EMULATED faults wrap the user's env)
    return type(inner or env).__name__


def _check_observation(env, call: str, obs) -> None:
    """An observation is the text the model reads next: anything else fails here, named, not in a chat template later."""
    if not isinstance(obs, str):
        raise UserFunctionError(
            f"{_name(env)}.{call} returned an observation of type {type(obs).__name__} ({str(obs)[:60]!r}); "
            "an observation is a string (the text the model reads next)"
        )
