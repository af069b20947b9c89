"""A user's own env and reward, declared in code (the paper's programming model): where each runs
is stated by its decorator, not by flow keys. Nothing here is part of rollart_dask; workers import
this file because a flow lists it in ``imports`` (flows/declared/corridor_flow.py does).

Corridor: the agent stands in a corridor of cells and must walk to the goal, which is on either
side; the observation draws both (``..P...G.``). Deterministic by seed.
"""

import random

import rollart_dask


@rollart_dask.env("corridor", affinity="decode")  # short prompts, many turns: decode-bound, the H20 pool
class Corridor:
    action_choices = ("L", "R")

    def __init__(self, length: int = 8):
        if length < 3:
            raise ValueError(f"corridor length must be >= 3, got {length}")
        self.length = length

    def reset(self, seed: int):
        rng = random.Random(seed)
        self.pos, self.goal = rng.sample(range(self.length), 2)
        self.steps = self.malformed = 0
        return self.render(), {"seed": seed}

    def render(self) -> str:
        cells = ["."] * self.length
        cells[self.goal], cells[self.pos] = "G", "P"
        return "".join(cells)

    def step(self, action: str):
        self.steps += 1
        move = {"L": -1, "R": 1}.get(action.strip().upper()[:1])
        if move is None:
            self.malformed += 1
        else:
            self.pos = min(max(self.pos + move, 0), self.length - 1)
        done = self.pos == self.goal
        info = {"success": done, "malformed": self.malformed, "steps": self.steps}
        return self.render(), float(done), done, False, info

    def close(self):
        pass


@rollart_dask.reward("corridor", stateless=True)  # reward.mode=serverless: deployed and invoked as a Lambda function
def corridor_reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    success = bool(info.get("success"))
    return {"score": (1.0 if success else 0.0) - 0.1 * int(info.get("malformed", 0)), "success": success}
