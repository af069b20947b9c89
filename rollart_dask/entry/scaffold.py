"""`rollart init DIR`: a project of one's own that runs as it is — a flow, an env and a reward written with the
decorators (the docs' first how-to), for the user to change."""

from __future__ import annotations

from pathlib import Path

import click

FLOW = """\
# Your flow: a small model learns your env on the embedded cluster (every stage real; the pool names
# stand in for GPU types). Run it: rollart run {dir}/flow.yaml   (--set trainer.steps=3 for a quick look)
# Every key: the flow reference (docs/reference/flow.md).
name: {name}
seed: 0
imports: [my_env.py, my_reward.py]   # your code: imported by the client and every worker
cluster:
  workers:
    - {{name: train-0, pools: [H800, TRAIN], nthreads: 2, torch_threads: 1}}
    - {{name: h800-0, pools: [H800], nthreads: 2, torch_threads: 1}}
    - {{name: h20-0, pools: [H20], nthreads: 2, torch_threads: 1}}
    - {{name: cpu-0, pools: [CPU], nthreads: 2}}
    - {{name: reward-0, pools: [SERVERLESS, REWARD], nthreads: 2}}
model: {{kind: tiny, hidden_size: 128, layers: 2, heads: 4, intermediate_size: 512}}
engine: {{backend: torch, temperature: 1.0, constrained: true}}
tasks:
  - name: walk
    env: {env}            # declared in my_env.py (its decorator also says where it runs)
    env_args: {{length: 8}}
    reward: {env}         # declared in my_reward.py
    max_turns: 8
    max_tokens: 2
rollout: {{mode: rollart, alpha: 1, group_size: 8, batch_groups: 8}}
trainer: {{steps: 200, max_minutes: 6, lr: 3.0e-4, entropy_coef: 0.05, checkpoint_every: 0}}
eval: {{every: 20, seeds: 100}}
"""

ENV = '''\
"""Your env: the agent stands on a line of cells and must walk to the goal, on either side (``..P...G.``).

An env is a class with reset(seed) -> (observation, info) and step(action) -> (observation, reward,
terminated, truncated, info); observations are text. ``action_choices`` lets a small model answer
with one of them (constrained decoding); a chat model writes free text instead.
"""
import random

import rollart_dask


@rollart_dask.env("{env}", affinity="decode")  # short prompts, many turns: decode-bound, the H20 pool
class LineWalk:
    action_choices = ("L", "R")

    def __init__(self, length: int = 8):
        if length < 3:
            raise ValueError(f"length must be >= 3, got {{length}}")
        self.length = length

    def reset(self, seed: int):
        rng = random.Random(seed)
        self.pos, self.goal = rng.sample(range(self.length), 2)
        self.steps = 0
        return self.render(), {{"seed": seed}}

    def render(self) -> str:
        cells = ["."] * self.length
        cells[self.goal], cells[self.pos] = "G", "P"
        return "".join(cells)

    def step(self, action: str):
        self.steps += 1
        move = {{"L": -1, "R": 1}}.get(action.strip().upper()[:1], 0)
        self.pos = min(max(self.pos + move, 0), self.length - 1)
        done = self.pos == self.goal
        return self.render(), float(done), done, False, {{"success": done, "steps": self.steps}}

    def expert_action(self) -> str:  # optional: lets `rollart check` and warm starts play a good move
        return "L" if self.goal < self.pos else "R"

    def close(self):
        pass
'''

REWARD = '''\
"""Your reward: a function of the finished trajectory (its turns and the env's last info).

It must return a finite number, or a dict with a finite "score" (and, optionally, "success"). stateless=True
lets reward.mode: serverless deploy it as a Lambda function.
"""
import rollart_dask


@rollart_dask.reward("{env}", stateless=True)
def line_walk_reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {{}})
    success = bool(info.get("success"))
    return {{"score": (1.0 if success else 0.0) - 0.02 * int(info.get("steps", 0)), "success": success}}
'''

README = """\
# {name}

    rollart check {dir}/flow.yaml        # your env and reward, played once, before any training
    rollart run {dir}/flow.yaml          # train (--set trainer.steps=3 for a quick look)

Change `my_env.py` and `my_reward.py`, then the task in `flow.yaml`. Each file says what it must provide.
"""


@click.command("init")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default=None, help="the flow's name (default: the directory's name)")
def init_command(directory, name):
    """Write a new project into DIRECTORY (new or empty): flow.yaml, my_env.py and my_reward.py written with the
    decorators, and a README; it runs as it is."""
    where = Path(directory)
    if where.exists() and (not where.is_dir() or any(where.iterdir())):
        raise click.ClickException(f"{where} is not empty: rollart init writes only into a new or empty directory")
    name = name or where.resolve().name
    env = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_") + "_walk"
    where.mkdir(parents=True, exist_ok=True)
    files = {"flow.yaml": FLOW, "my_env.py": ENV, "my_reward.py": REWARD, "README.md": README}
    for file, text in files.items():
        (where / file).write_text(text.format(name=name, env=env, dir=directory))
    click.echo(f"wrote {', '.join(files)} into {where}/\n  rollart check {where}/flow.yaml\n  rollart run {where}/flow.yaml")
