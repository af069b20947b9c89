"""Adapters that expose other libraries' environments through this package's text contract.

``GymnasiumText(env_id, max_turns=None, **make_kwargs)`` wraps a Gymnasium env by id.
Observation: a text rendering. The toy-text envs (FrozenLake, Taxi, CliffWalking, Blackjack)
get compact renderers without colour escapes, because their own ``ansi`` rendering marks the
agent only with terminal colours; any other env uses ``render_mode="ansi"`` when it offers it
(escapes stripped), else ``str(obs)``. Action: for a Discrete space, one of ``action_choices``
(meaningful names for the toy-text envs, else the indices ``"0".."n-1"``); an index is always
accepted too. Other spaces take whitespace/comma separated numbers. Anything unparsable is
malformed: the env is not stepped. Success rule (``success=``): ``"positive"`` (default) is an
episode that terminated on a reward > 0 (FrozenLake goal, Taxi drop-off, Blackjack win);
``"terminated"`` is any termination (CliffWalking's only terminal state is its goal, reached
with reward -1, so that is its default).

``TextArenaEnv(env_id, max_turns=None, **kwargs)`` wraps a single-player TextArena env by id.
Observation: the player's text observation (with the registered wrappers: the default ids
accumulate the whole game log, the ``-train`` ids show the prompt and the current board).
Action: the text itself. TextArena scores only at the end: the step that ends the game carries
its reward (1 for a win, else a completion fraction, by TextArena's rules); success is a final
reward >= 1; an episode cut by ``max_turns`` first has return 0. TextArena's invalid moves (bad format or an illegal move: it does not tell them
apart) are counted in ``info["malformed"]``; by its rules the second invalid move in a row
ends the game. Single-player ids that run offline in textarena 0.7.4 (base ids; their ``-train``
and ``-raw`` variants too): GuessTheNumber-v0, TowerOfHanoi-v0, Sokoban-v0, FrozenLake-v0,
FrozenLake-v0-random, 2048-v0-*, LightsOut-v0, Minesweeper-v0, Mastermind-v0, FifteenPuzzle-v0,
PegJump-v0, RushHour-v0, Bandit-v0, Blackjack-v0, Countdown-v0, Cryptarithm-v0, Crosswords-v0,
LogicPuzzle-v0, Secretary-v0, Set-v0, Slitherlink-v0, Sudoku-v0, ThreeCardMonte-v0. Not usable
here: the word games (Wordle, Hangman, WordLadder, WordSearch) need nltk corpora, GuessWho and
TwentyQuestions an API key, and Klondike and UltimateTexasHoldem do not import on Python 3.11.

Both are deterministic by seed. ``info`` carries success, return (sum of rewards), malformed,
turns and valid, all JSON-serialisable.
"""

from __future__ import annotations

import random
import re
import threading
from contextlib import contextmanager

import numpy as np

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_DIRECTION_WORDS = {"L": "LEFT", "D": "DOWN", "R": "RIGHT", "U": "UP"}


def _render_frozenlake(env) -> str:
    row, col = divmod(int(env.s), env.ncol)
    lines = [[c.decode() for c in line] for line in env.desc.tolist()]
    lines[row][col] = "P"  # as FrozenLakeText: P marks the agent
    return "\n".join("".join(line) for line in lines)


def _render_cliffwalking(env) -> str:
    rows, cols = env.shape
    agent = np.unravel_index(int(env.s), env.shape)
    out = []
    for r in range(rows):
        line = []
        for c in range(cols):
            line.append("x" if (r, c) == agent else "T" if (r, c) == (rows - 1, cols - 1) else "C" if env._cliff[r, c] else "o")
        out.append("".join(line))
    return "\n".join(out)


def _render_taxi(env) -> str:
    taxi_row, taxi_col, pass_idx, dest_idx = env.decode(int(env.s))
    lines = [[c.decode() for c in line] for line in env.desc.tolist()]
    lines[1 + taxi_row][2 * taxi_col + 1] = "T"
    names = "RGYB"
    passenger = "taxi" if pass_idx == 4 else names[pass_idx]
    return "\n".join("".join(line) for line in lines) + f"\npassenger: {passenger}\ndestination: {names[dest_idx]}"


def _render_blackjack(env) -> str:
    total, dealer, ace = env._get_obs()
    return f"player: {int(total)}\ndealer: {int(dealer)}\nusable ace: {'yes' if ace else 'no'}"


# Env class -> (action names by index, aliases, renderer, success rule).
_TOY = "gymnasium.envs.toy_text."
_KNOWN = {
    _TOY + "frozen_lake.FrozenLakeEnv": (("L", "D", "R", "U"), _DIRECTION_WORDS, _render_frozenlake, "positive"),
    _TOY + "cliffwalking.CliffWalkingEnv": (("U", "R", "D", "L"), _DIRECTION_WORDS, _render_cliffwalking, "terminated"),
    _TOY + "taxi.TaxiEnv": (("south", "north", "east", "west", "pickup", "dropoff"), {}, _render_taxi, "positive"),
    _TOY + "blackjack.BlackjackEnv": (("stick", "hit"), {}, _render_blackjack, "positive"),
}


class GymnasiumText:
    """A Gymnasium env by id as a text env. Deterministic by seed (``env.reset(seed=seed)``)."""

    action_choices: tuple[str, ...] | None = None

    def __init__(self, env_id: str, max_turns: int | None = None, success: str | None = None, **make_kwargs):
        import gymnasium as gym
        from gymnasium.envs.registration import load_env_creator

        spec = gym.spec(env_id)
        creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
        modes = getattr(creator, "metadata", {}).get("render_modes", [])
        kwargs = {"disable_env_checker": True, **make_kwargs}  # the checker costs time on every reset
        known = _KNOWN.get(f"{getattr(creator, '__module__', '')}.{getattr(creator, '__qualname__', '')}")
        if known is None and "ansi" in modes:
            kwargs.setdefault("render_mode", "ansi")
        self._env = gym.make(env_id, **kwargs)
        self.env_id, self.max_turns = env_id, max_turns
        space = self._env.action_space
        self._discrete = isinstance(space, gym.spaces.Discrete)
        names, aliases, self._renderer, default_success = known if known else (None, {}, None, "positive")
        self.success_rule = success or default_success
        if self.success_rule not in ("positive", "terminated"):
            raise ValueError(f"success must be 'positive' or 'terminated', got {success!r}")
        self._lookup: dict[str, int] = {}
        if self._discrete:
            start, n = int(space.start), int(space.n)
            if names is None or len(names) != n:
                names = tuple(str(start + i) for i in range(n))
            self.action_choices = tuple(names)
            for i, name in enumerate(names):
                self._lookup[name.upper()] = start + i
                self._lookup[str(start + i)] = start + i
                if name in aliases:
                    self._lookup[aliases[name]] = start + i
        self._obs = None
        self.turns = self.malformed = 0
        self.total, self.success = 0.0, False

    def parse_action(self, text: str):
        """The env action for free text, or None when it is malformed."""
        word = text.strip()
        if self._discrete:
            return self._lookup.get(word.upper())
        space = self._env.action_space
        try:
            values = [float(v) for v in _NUMBER.findall(word)]
            action = np.asarray(values, dtype=space.dtype).reshape(space.shape)
        except (ValueError, TypeError):
            return None
        return action if space.contains(action) else None

    def reset(self, seed: int):
        self._obs, _ = self._env.reset(seed=seed)
        self.turns = self.malformed = 0
        self.total, self.success = 0.0, False
        return self.render(), {"seed": seed, "env_id": self.env_id}

    def render(self) -> str:
        if self._renderer is not None:
            return self._renderer(self._env.unwrapped)
        if self._env.render_mode == "ansi":
            text = _ANSI.sub("", self._env.render())
            return "\n".join(line.rstrip() for line in text.strip("\n").split("\n"))
        if isinstance(self._obs, np.ndarray):
            return np.array2string(self._obs, precision=4, threshold=1 << 30, max_line_width=1 << 30)
        return str(self._obs)

    def step(self, action: str):
        self.turns += 1
        parsed = self.parse_action(action)
        reward, terminated, truncated = 0.0, False, False
        if parsed is None:
            self.malformed += 1
        else:
            self._obs, reward, terminated, truncated, _ = self._env.step(parsed)
            reward = float(reward)
            self.total += reward
            if terminated:
                self.success = reward > 0 if self.success_rule == "positive" else True
        truncated = bool(truncated) or (not terminated and self.max_turns is not None and self.turns >= self.max_turns)
        info = {
            "success": self.success,
            "return": round(self.total, 6),
            "malformed": self.malformed,
            "turns": self.turns,
            "valid": parsed is not None,
        }
        return self.render(), reward, bool(terminated), truncated, info

    def close(self):
        if self._env is not None:
            self._env.close()
            self._env = None


def _number(value) -> float:
    # A few TextArena games (Countdown, Cryptarithm, Slitherlink) pass set_invalid_move's
    # arguments in the wrong order, leaving the reason text where the reward belongs.
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


# TextArena draws from the process-global `random` (and some games from numpy's global
# generator). Each TextArenaEnv keeps its own copy of both states and swaps it in under a lock,
# so episodes stay deterministic by seed even when many envs share a worker's threads.
_GLOBAL_RNG_LOCK = threading.Lock()


class TextArenaEnv:
    """A single-player TextArena env by id. Deterministic by seed."""

    action_choices = None  # free text

    def __init__(self, env_id: str, max_turns: int | None = None, **kwargs):
        try:
            import textarena  # noqa: F401  (fail here, not at the first reset, when it is missing)
        except ImportError as e:
            raise ImportError(
                "the TextArena adapter needs the package 'textarena', which is not installed: pip install 'rollart-dask[envs]'"
            ) from e

        self.env_id, self.max_turns, self.kwargs = env_id, max_turns, kwargs
        self._env = None
        self._rng_state = None
        self.turns = self.malformed = 0
        self.total, self.success, self.done = 0.0, False, False

    @contextmanager
    def _own_rng(self):
        with _GLOBAL_RNG_LOCK:
            saved = random.getstate(), np.random.get_state()
            try:
                if self._rng_state is not None:
                    random.setstate(self._rng_state[0])
                    np.random.set_state(self._rng_state[1])
                yield
            finally:
                self._rng_state = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])

    def reset(self, seed: int):
        import textarena as ta

        self._rng_state = None
        with self._own_rng():
            random.seed(seed)
            np.random.seed(seed % 2**32)
            # A fresh env per episode (TextArena's observation wrappers keep their log across
            # resets), made under the seed: some games draw their puzzle in the constructor.
            self._env = ta.make(self.env_id, **self.kwargs)
            try:
                self._env.reset(num_players=1, seed=seed)
            except AssertionError as e:
                raise ValueError(f"textarena env {self.env_id!r} is not single-player: {e}") from e
            _, obs = self._env.get_observation()
        self.turns = self.malformed = 0
        self.total, self.success, self.done = 0.0, False, False
        return str(obs), {"seed": seed, "env_id": self.env_id}

    def step(self, action: str):
        self.turns += 1
        state = self._env.state
        errors_before = getattr(state, "error_count", 0)
        with self._own_rng():
            done, _ = self._env.step(action)
            _, obs = self._env.get_observation()
        game_info = (getattr(state, "game_info", None) or {}).get(0, {})
        invalid = getattr(state, "error_count", 0) > errors_before or (done and bool(game_info.get("invalid_move")))
        self.malformed += int(invalid)
        reward = 0.0
        if done:
            self.done = True
            reward = _number((state.rewards or {}).get(0))
            self.total += reward
            self.success = reward >= 1.0
        truncated = not done and self.max_turns is not None and self.turns >= self.max_turns
        info = {
            "success": self.success,
            "return": round(self.total, 6),
            "malformed": self.malformed,
            "turns": self.turns,
            "valid": not invalid,
        }
        if done and game_info.get("reason"):
            info["reason"] = str(game_info["reason"])
        return str(obs), reward, bool(done), truncated, info

    def close(self):
        self._env = None
