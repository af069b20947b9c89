"""Reward runner: scores finished trajectories, in one of two modes.

- ``local`` (the paper's baseline): the reward function runs in this worker's process, a worker
  reserved for rewards (pool REWARD).
- ``serverless``: this worker (pool SERVERLESS) only invokes the deployed function through the
  AWS Lambda API with boto3 — AWS itself or the local endpoint — many invocations at once.
  A reward that cannot be obtained raises: it is never replaced by a default value.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from ..registry import get_reward


def _check(name: str, out) -> dict:
    if isinstance(out, (int, float)):
        out = {"score": float(out)}
    if not isinstance(out, dict) or not isinstance(out.get("score"), (int, float)):
        raise TypeError(f"reward {name!r} returned {out!r}; expected a float or a dict with a numeric 'score'")
    return out


class RewardRunner:
    def __init__(self, mode: str = "local", endpoint_url: str | None = None, region: str = "us-east-1", token: str | None = None,
                 retries: int = 6, timeout_s: float = 60.0, threads: int = 16):
        self.mode, self.retries, self.timeout_s = mode, retries, timeout_s
        self.stats = {"calls": 0, "busy_s": 0.0, "cold_starts": 0, "throttles": 0, "retries": 0, "billed_ms": 0.0, "errors": 0}
        self.client = None
        if mode == "serverless":
            from ..serverless import make_lambda_client

            url = None if endpoint_url in (None, "aws") else endpoint_url
            self.client = make_lambda_client(url, region=region, timeout_s=timeout_s, token=token, max_connections=threads)
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="reward-invoke")

    def score(self, item: dict) -> dict:
        if self.mode == "serverless":
            return self._invoke(item)
        t0 = time.perf_counter()
        out = _check(item["reward"], get_reward(item["reward"])(item["trajectory"]))
        self.stats["calls"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        return out

    def map(self, fn, items: list):
        """How a batch is scored: serverless invocations run concurrently, local calls in turn."""
        return self.pool.map(fn, items) if self.mode == "serverless" else map(fn, items)

    def _invoke(self, item: dict) -> dict:
        from ..serverless import RewardError, invoke_reward

        try:
            out, st = invoke_reward(self.client, item["function"], item["trajectory"], retries=self.retries, timeout_s=self.timeout_s)
        except RewardError as e:
            self.stats["errors"] += 1
            self._count(e.stats)
            raise
        self._count(st)
        return _check(item["function"], out)

    def _count(self, st) -> None:
        if st is None:
            return
        self.stats["calls"] += 1
        self.stats["cold_starts"] += int(bool(st.cold_start))
        self.stats["throttles"] += st.throttles
        self.stats["retries"] += st.retries
        self.stats["billed_ms"] += float(st.billed_ms or 0)
        # the caller's busy time is waiting, not reward compute: billed duration is the capacity used
