"""Reward plane set-up: where rewards run (``reward.mode``) and, when serverless, the Lambda
functions behind them — on AWS, on an endpoint given by URL, or on a local endpoint started for
the run on 127.0.0.1.

Utilisation of reward capacity, as the paper compares it: ``local`` = busy time / reserved
time of the dedicated worker; ``serverless`` = billed duration / lifetime of the execution
environments that were provisioned (what a serverless platform keeps warm for the run).
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

from .config import FlowConfig
from .observe import console
from .pools import REWARD_POOL


def function_name(prefix: str, reward: str) -> str:
    """A valid Lambda function name (letters, digits, - and _; at most 64)."""
    return (prefix + re.sub(r"[^A-Za-z0-9_-]+", "-", reward))[:64]


class RewardPlane:
    def __init__(self, cfg: FlowConfig, out_dir: Path):
        self.cfg, self.out = cfg, out_dir
        self.mode = cfg.reward.mode
        self.pool = REWARD_POOL[self.mode]
        self.functions: dict[str, str] = {}  # reward name → function name
        self.endpoint = None  # a local endpoint started for this run
        self.url: str | None = None
        self._prev: dict = {}
        self._prev_endpoint = (0.0, 0.0)  # (environment lifetime s, billed s) at the last step

    async def start(self) -> dict:
        """Start/deploy what the mode needs; returns the spec of the reward runner."""
        r = self.cfg.reward
        if self.mode == "local":
            return {"mode": "local"}
        from .serverless import deploy, make_lambda_client, start_local_endpoint

        if r.endpoint_url is None:
            self.endpoint = await asyncio.to_thread(start_local_endpoint, host="127.0.0.1", port=0, state_dir=str(self.out / "lambda"),
                                                    keep_warm_s=r.keep_warm_s, mode="process")
            self.url = self.endpoint.url
            console.print(f"reward endpoint (local, Lambda API): {self.url}")
        else:
            self.url = None if r.endpoint_url == "aws" else r.endpoint_url
        client = make_lambda_client(self.url, region=r.region)
        for reward in sorted({t.reward for t in self.cfg.tasks}):
            name = function_name(r.function_prefix, reward)
            if r.deploy:
                out = await asyncio.to_thread(deploy, name, reward, client, role_arn=r.role_arn, timeout=r.function_timeout_s,
                                              memory=r.memory_mb, concurrency=r.concurrency)
                console.print(f"reward {reward}: {out['action']} {out['function_arn']}")
            self.functions[reward] = name
        return {"mode": "serverless", "endpoint_url": self.url or "aws", "region": r.region, "retries": r.invoke_retries,
                "timeout_s": self.cfg.rollout.reward_timeout_s, "threads": r.invoke_threads}

    def step_stats(self, runner_stats: list[dict], wall_s: float, n_reserved: int) -> dict:
        """Per-step reward metrics from the reward runners' cumulative counters (deltas since the last call)."""
        total: dict[str, float] = {}
        for st in runner_stats:
            for k, v in st.items():
                total[k] = total.get(k, 0.0) + v
        delta = {k: v - self._prev.get(k, 0.0) for k, v in total.items()}
        self._prev = total
        out = {"mode": self.mode, "calls": int(delta.get("calls", 0))}
        if self.mode == "local":
            out["utilisation"] = round(delta.get("busy_s", 0.0) / max(wall_s * max(n_reserved, 1), 1e-9), 4)
            return out
        out.update(cold_starts=int(delta.get("cold_starts", 0)), throttles=int(delta.get("throttles", 0)),
                   retries=int(delta.get("retries", 0)), errors=int(delta.get("errors", 0)), billed_s=round(delta.get("billed_ms", 0.0) / 1000, 4))
        if self.endpoint is not None:
            fns = self.endpoint.stats().get("functions", {})
            alive = sum(f.get("alive_s", 0.0) for f in fns.values())
            billed = sum(f.get("billed_ms", 0) for f in fns.values()) / 1000
            d_alive, d_billed = alive - self._prev_endpoint[0], billed - self._prev_endpoint[1]
            self._prev_endpoint = (alive, billed)
            out["utilisation"] = round(d_billed / d_alive, 4) if d_alive > 0 else 0.0
            out["environments"] = sum(f.get("environments", 0) for f in fns.values())
        return out

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None
