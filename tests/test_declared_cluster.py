"""The declarative API end to end: a user's module outside the package (decorated env and rewards) and a
Python flow file, run through `rollart run` on the shared cluster. The env's declared affinity decides
the pool its generation lands on (a flow key still overrides it); the stateless reward runs as a Lambda
function behind the local endpoint (it refuses to score anywhere else); the reward declared
stateless=False runs on a REWARD worker and is never deployed."""

import json
import os
import textwrap

import pytest
from click.testing import CliRunner
from distributed import Client

from rollart_dask.entry.cli import main
from tests.conftest import flow_dict

USER_MODULE = """
import os

import rollart_dask


@rollart_dask.env("corridor-user", affinity="decode")
class Corridor:
    action_choices = ("L", "R")

    def __init__(self, log=None):
        self.log = log

    def reset(self, seed):
        self.pos, self.goal, self.n = seed % 3, 3, 0
        return self.render(), {"log": self.log}

    def render(self):
        return "".join("P" if i == self.pos else "G" if i == self.goal else "." for i in range(5))

    def step(self, action):
        self.n += 1
        self.pos = max(0, min(4, self.pos + (1 if action.strip().upper().startswith("R") else -1)))
        done = self.pos == self.goal
        return self.render(), float(done), done, False, {"success": done, "log": self.log}

    def close(self):
        pass


@rollart_dask.reward("corridor-lambda", stateless=True)
def in_lambda(trajectory):
    if "AWS_LAMBDA_FUNCTION_NAME" not in os.environ:
        raise RuntimeError("a stateless reward of a serverless run must be invoked as a Lambda function")
    print("scored by", os.environ["AWS_LAMBDA_FUNCTION_NAME"], flush=True)
    return float(trajectory["info"].get("success", False))


CALLS = []  # the state a stateless=False reward keeps between calls


@rollart_dask.reward("corridor-kept", stateless=False)
def on_reward_pool(trajectory):
    if "AWS_LAMBDA_FUNCTION_NAME" in os.environ:
        raise RuntimeError("a stateless=False reward is never a Lambda function")
    CALLS.append(1)
    with open(trajectory["info"]["log"], "a") as f:  # which process scored it: the test compares with the REWARD worker's
        f.write(f"{os.getpid()}\\n")
    return {"score": float(trajectory["info"].get("success", False)), "calls_here": len(CALLS)}
"""


@pytest.mark.slow  # ~30 s; the default stage is at its 20-minute budget (the declarations' own tests: test_declared_on_cpu.py)
def test_user_module_with_declared_placement_runs_through_rollart_run(address, tmp_path):
    code = tmp_path / "user"
    code.mkdir()
    (code / "corridor_user_mod.py").write_text(USER_MODULE)
    scored_in = tmp_path / "kept-pids.txt"
    tasks = [
        {"name": "declared", "env": "corridor-user", "reward": "corridor-lambda", "max_turns": 4, "max_tokens": 2},
        {
            "name": "overridden",
            "env": "corridor-user",
            "reward": "corridor-kept",
            "affinity": "prefill",
            "max_turns": 4,
            "max_tokens": 2,
            "env_args": {"log": str(scored_in)},
        },
    ]
    data = flow_dict(**{"tasks": tasks, "reward.mode": "serverless", "imports": ["user/corridor_user_mod.py"], "eval.seeds": 2})
    (tmp_path / "user_flow.py").write_text(
        textwrap.dedent(f"""
        # a Python flow file: `flow` may be a dict (or a FlowConfig, or a function returning one)
        flow = {data!r}
    """)
    )
    out = tmp_path / "run"
    res = CliRunner().invoke(
        main, ["run", str(tmp_path / "user_flow.py"), "--scheduler", address, "--out", str(out)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "task declared: affinity decode (declared by @rollart_dask.env) → generation on H20" in text
    assert "task overridden: affinity prefill (flow (its env declares decode)) → generation on H800" in text
    assert "reward corridor-kept: declared stateful" in text

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["accounting"]["unaccounted"] == 0
    landed = summary["generate_pools"]  # generate calls per task and pool, evaluation included
    assert set(landed["declared"]) == {"H20"} and landed["declared"]["H20"] > 0
    assert set(landed["overridden"]) == {"H800"} and landed["overridden"]["H800"] > 0
    assert not any(k.startswith("failed") and v for k, v in summary["counts"].items()) and not summary["counts"].get("reward_errors"), (
        summary["counts"]
    )

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    calls = {"corridor-lambda": 0, "corridor-kept": 0}
    for row in rows:
        for name, r in (row.get("reward") or {}).get("rewards", {}).items():
            calls[name] += r["calls"]
            assert (
                r["where"]
                == {"corridor-lambda": "SERVERLESS (Lambda rollart-reward-corridor-lambda)", "corridor-kept": "REWARD (declared stateful)"}[
                    name
                ]
            )
    assert calls["corridor-lambda"] > 0 and calls["corridor-kept"] > 0, calls
    with Client(address) as c:  # the stateless=False reward ran in the REWARD worker's process, and only there
        pids = {info["name"]: pid for addr, pid in c.run(os.getpid).items() for info in [c.scheduler_info()["workers"][addr]]}
    assert set(scored_in.read_text().split()) == {str(pids["reward-0"])}
    logs = out / "lambda" / "logs"
    assert sorted(p.name for p in logs.iterdir() if p.suffix == ".log") == [
        "rollart-reward-corridor-lambda.log"
    ]  # corridor-kept: never deployed
    assert "scored by rollart-reward-corridor-lambda" in (logs / "rollart-reward-corridor-lambda.log").read_text()
