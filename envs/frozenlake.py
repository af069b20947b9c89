"""FrozenLake with random maps, as a text env.

Gymnasium's FrozenLake does the dynamics; this class renders the map as text and
parses text actions. ``view: grid`` (a small model's): the grid, one row per line, ``P``
marks the agent (S start, F frozen, H hole, G goal); action: one of ``L D R U`` (the words
left, down, right, up are accepted too). ``view: words`` (a chat model's): the position,
the goal and the holes in a sentence; action: free text, whose first move word (left,
down, right, up) is the move. Anything else is malformed: the agent does not move,
``info["malformed"]`` counts it, and the reward function applies a format penalty.
"""

from __future__ import annotations

import re

from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

ACTIONS = {"L": 0, "D": 1, "R": 2, "U": 3}
WORDS = {"LEFT": "L", "DOWN": "D", "RIGHT": "R", "UP": "U"}
MOVE_WORD = re.compile(r"\b(left|down|right|up)\b", re.IGNORECASE)


def parse_action(text: str) -> str | None:
    """Return the action letter for a one-word action, or None when it is malformed."""
    word = text.strip().upper()
    if word in ACTIONS:
        return word
    return WORDS.get(word)


def parse_free_text(text: str) -> str | None:
    """The move of a free-text answer: a one-word action, else the first move word in it (None: malformed)."""
    letter = parse_action(text)
    if letter is not None:
        return letter
    found = MOVE_WORD.search(text)
    return WORDS[found.group(1).upper()] if found else None


def _cell(r: int, c: int) -> str:
    return f"row {r + 1} column {c + 1}"


class FrozenLakeText:
    """Random-map FrozenLake. Deterministic by seed: the seed picks the map."""

    action_choices = tuple(ACTIONS)

    def __init__(self, size: int = 4, p: float = 0.8, slippery: bool = False, max_turns: int | None = None, view: str = "grid"):
        if size < 2:
            raise ValueError(f"frozenlake size must be >= 2, got {size}")
        if not 0 < p <= 1:
            raise ValueError(f"frozenlake p (frozen-tile probability) must be in (0, 1], got {p}")
        if view not in ("grid", "words"):
            raise ValueError(f"frozenlake view must be 'grid' or 'words', got {view!r}")
        self.size, self.p, self.slippery, self.max_turns, self.view = size, p, slippery, max_turns, view
        if view == "words":  # free text: the move words, for an engine that constrains decoding to them
            self.action_choices = tuple(w.lower() for w in WORDS)
        self._env: FrozenLakeEnv | None = None
        self.turns = 0
        self.malformed = 0

    def reset(self, seed: int):
        desc = generate_random_map(size=self.size, p=self.p, seed=seed)
        # The env class itself, not gym.make: make's checker wrappers cost milliseconds per reset.
        self._env = FrozenLakeEnv(desc=desc, is_slippery=self.slippery)
        self._state, _ = self._env.reset(seed=seed)
        self.turns = 0
        self.malformed = 0
        self.success = False
        self.fell = False
        self.start_distance = len(self.shortest_path() or "")
        return self.render(), {"seed": seed, "map": desc, "distance": self.start_distance, "start_distance": self.start_distance}

    def render(self) -> str:
        desc = self._env.desc  # type: ignore[union-attr]
        row, col = divmod(int(self._state), self.size)
        if self.view == "words":
            cells = [(r, c) for r in range(self.size) for c in range(self.size)]
            goal = next(_cell(r, c) for r, c in cells if desc[r][c] == b"G")
            holes = [_cell(r, c) for r, c in cells if desc[r][c] == b"H"]
            return (
                f"The lake has {self.size} rows and {self.size} columns. You are at {_cell(row, col)}. The goal is at {goal}. "
                f"Holes: {', '.join(holes) if holes else 'none'}. Moving down increases the row, right increases the column."
            )
        lines = []
        for r in range(self.size):
            chars = [c.decode() for c in desc[r]]
            if r == row:
                chars[col] = "P"
            lines.append("".join(chars))
        return "\n".join(lines)

    def step(self, action: str):
        self.turns += 1
        letter = parse_free_text(action) if self.view == "words" else parse_action(action)
        reward, terminated = 0.0, False
        if letter is None:
            self.malformed += 1
        else:
            self._state, reward, terminated, _, _ = self._env.step(ACTIONS[letter])  # type: ignore[union-attr]
            self.success = bool(reward > 0)
            self.fell = bool(terminated and not self.success)
        truncated = not terminated and self.max_turns is not None and self.turns >= self.max_turns
        path = None if self.fell else self.shortest_path()
        info = {
            "success": self.success,
            "malformed": self.malformed,
            "turns": self.turns,
            "valid": letter is not None,
            "fell": self.fell,
            "distance": None if path is None else len(path),
            "start_distance": self.start_distance,
        }
        return self.render(), float(reward), bool(terminated), truncated, info

    def close(self):
        if self._env is not None:
            self._env.close()
            self._env = None

    def expert_action(self) -> str | None:
        """The first move of a shortest path to the goal (demonstrations for a warm start)."""
        path = self.shortest_path()
        return path[0] if path else None

    # Solver for demonstrations (warm start) and tests: a shortest path by BFS.
    def shortest_path(self) -> str | None:
        desc = self._env.desc  # type: ignore[union-attr]
        n = self.size
        start = divmod(int(self._state), n)
        moves = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
        frontier, seen = [(start, "")], {start}
        while frontier:
            nxt = []
            for (r, c), path in frontier:
                if desc[r][c] == b"G":
                    return path
                for a, (dr, dc) in moves.items():
                    rr, cc = min(max(r + dr, 0), n - 1), min(max(c + dc, 0), n - 1)
                    if (rr, cc) not in seen and desc[rr][cc] != b"H":
                        seen.add((rr, cc))
                        nxt.append(((rr, cc), path + a))
            frontier = nxt
        return None
