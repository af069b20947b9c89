"""Reward runner: scores finished trajectories, in one of two modes.

- ``local`` (the paper's baseline): the reward function runs in this worker's process, a worker
  reserved for rewards (pool REWARD).
- ``serverless``: this worker (pool SERVERLESS) only invokes the deployed function through the
  AWS Lambda API with boto3 — AWS itself or the local endpoint — many invocations at once.

Stateful rewards (a reward module with ``NEEDS_ENGINE = True``, e.g. the LLM judge) need an
inference engine and stay local in both modes: they are scored on a REWARD worker, whose runner
builds the judge engine (only when the flow uses such a reward) and scores a batch of them with
one greedy generation restricted to the reward's choices. The control plane sends their calls
to the REWARD pool whatever the mode, as it does a reward declared ``stateless=False``
(``pinned``: scored in-process there, never invoked as a function).

A reward that cannot be obtained raises: it is never replaced by a default value.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from rollart_dask.registry import get_reward, stateful_reward
from rollart_dask.data.encoding import chat_prompt_ids
from rollart_dask.data.reward_value import reward_value
from rollart_dask.usercode import user_error


def call_reward(name: str, fn, *args):
    """The user's reward function called; what it raises comes back as their fault, named (usercode.UserFunctionError)."""
    try:
        return fn(*args)
    except Exception as e:
        raise user_error(f"reward {name!r} ({getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')})", e) from e


def _err(e: BaseException) -> tuple:
    return ("err", f"{type(e).__name__}: {e}")


class RewardRunner:
    """``local``: this worker scores in-process (reward.mode local, or a REWARD worker hosting the
    stateful rewards of a serverless run). ``caller``: this worker invokes Lambda functions."""

    stats: dict  # the RewardRunner contract's counters (data/contracts.py)

    def __init__(
        self,
        mode: str = "local",
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        token: str | None = None,
        retries: int = 6,
        timeout_s: float = 60.0,
        threads: int = 16,
        stateful=(),
        judge_model: str | None = "smollm2",
        judge_max_batch: int = 32,
        seed: int = 0,
        local: bool | None = None,
        caller: bool | None = None,
        pinned=(),
    ):
        self.mode, self.retries, self.timeout_s = mode, retries, timeout_s
        self.local = (mode == "local") if local is None else bool(local)
        self.caller = (mode == "serverless") if caller is None else bool(caller)
        self.stateful = set(stateful)  # rewards the control plane found stateful
        self.pinned = set(pinned)  # declared stateless=False: scored in-process here in either mode (no Lambda function)
        self.judge_model, self.judge_max_batch, self.seed = judge_model, judge_max_batch, seed
        self.judge_dir: str | None = None
        self._judge = None
        self._judge_lock = threading.Lock()
        self._kind: dict[str, bool] = {}
        self.stats = {
            "calls": 0,
            "busy_s": 0.0,
            "cold_starts": 0,
            "throttles": 0,
            "retries": 0,
            "billed_ms": 0.0,
            "errors": 0,
            "local_calls": 0,
            "judge_calls": 0,
            "judge_batches": 0,
            "judge_s": 0.0,
            "judge_errors": 0,
            "n_local": int(self.local),
        }  # n_*: gauges, not counters
        self.client = None
        if self.caller:
            from rollart_dask.data.serverless import make_lambda_client

            url = None if endpoint_url in (None, "aws") else endpoint_url
            self.client = make_lambda_client(url, region=region, timeout_s=timeout_s, token=token, max_connections=threads)
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="reward-invoke")
        if self.local and self.stateful:
            self.judge_engine()  # the flow uses a stateful reward: load its engine now, not inside the first reward's timeout

    # -- routing ----------------------------------------------------------------------------
    def is_stateful(self, name: str) -> bool:
        if name in self.stateful:
            return True
        if self.mode == "serverless":  # the control plane decided; a caller does not import reward code
            return False
        if name not in self._kind:
            try:
                self._kind[name] = stateful_reward(name) is not None
            except Exception:  # an unknown reward fails on the plain path, per item
                return False
        return self._kind[name]

    # -- plain rewards ----------------------------------------------------------------------
    def score(self, item: dict) -> dict:
        if self.mode == "serverless" and item["reward"] not in self.pinned:
            return self._invoke(item)
        if not self.local:
            raise RuntimeError(f"reward {item['reward']!r} runs in-process on the REWARD pool, not on this reward caller")
        t0 = time.perf_counter()
        out = reward_value(item["reward"], call_reward(item["reward"], get_reward(item["reward"]), item["trajectory"]))
        self._count_local(item["reward"], 1, time.perf_counter() - t0)
        return out

    def map(self, fn, items: list):
        """How a batch is scored: serverless invocations run concurrently; in-process calls (local mode, or a reward
        declared stateless=False, whose state need not be thread-safe) in turn, in the task's thread."""
        if not (self.mode == "serverless" and self.caller):
            return map(fn, items)
        out: list = [None] * len(items)
        invoked = [i for i, item in enumerate(items) if item["reward"] not in self.pinned]
        for i, r in zip(invoked, self.pool.map(fn, [items[i] for i in invoked])):
            out[i] = r
        for i in sorted(set(range(len(items))) - set(invoked)):
            out[i] = fn(items[i])
        return out

    def _count_local(self, name: str, n: int, seconds: float) -> None:
        st = self.stats
        st["calls"] += n
        st["local_calls"] += n
        st["busy_s"] += seconds
        self._count_reward(name, n, seconds)

    def _count_reward(self, name: str, n: int, seconds: float) -> None:
        """Per-reward calls and the time callers waited for them (``rewards.<name>`` metrics)."""
        self.stats[f"calls:{name}"] = self.stats.get(f"calls:{name}", 0) + n
        self.stats[f"time_s:{name}"] = self.stats.get(f"time_s:{name}", 0.0) + seconds

    # -- stateful rewards (the judge) ---------------------------------------------------------
    def judge_engine(self):
        """The judge engine, built on first use (TorchEngine over ``judge_model``)."""
        with self._judge_lock:
            if self._judge is None:
                if not self.local:
                    raise RuntimeError("this reward worker does not host stateful rewards (they run on the REWARD pool)")
                model_dir = self.judge_model
                if model_dir in (None, "smollm2"):
                    from rollart_dask.models.smollm2 import build_smollm2

                    model_dir = str(build_smollm2())
                elif model_dir == "policy":
                    raise ValueError("reward.judge_model 'policy' must be resolved to the run's model directory by the control plane")
                from rollart_dask.data.engine_torch import TorchEngine

                self._judge = TorchEngine(str(model_dir), seed=self.seed, max_batch=self.judge_max_batch)
                self.judge_dir = str(model_dir)
        return self._judge

    def _judge_request(self, engine, req: dict) -> dict:
        ids = chat_prompt_ids(engine.tokenizer, req.get("messages") or req["prompt"], add_generation_prompt=True)
        return {
            "id": f"judge-{uuid.uuid4().hex[:12]}",
            "prompt_ids": ids,
            "choices": req.get("choices"),
            "max_tokens": int(req.get("max_tokens", 16)),
            "temperature": float(req.get("temperature", 0.0)),
        }

    def score_stateful(self, items: list[dict]) -> list[tuple]:
        """Score stateful-reward items: one batched generation per reward; per item ("ok", score) or ("err", message)."""
        out: list = [None] * len(items)
        by_reward: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_reward.setdefault(item["reward"], []).append(i)
        for name, idx in by_reward.items():
            t0 = time.perf_counter()
            try:
                module = stateful_reward(name)
                if module is None:
                    raise TypeError(f"reward {name!r} is not stateful (its module does not set NEEDS_ENGINE)")
                fn = get_reward(name)
                engine = self.judge_engine()
            except Exception as e:
                for i in idx:
                    out[i] = _err(e)
                self.stats["judge_errors"] += len(idx)
                continue
            reqs = []
            for i in idx:
                try:
                    reqs.append((i, self._judge_request(engine, module.request(items[i]["trajectory"]))))
                except Exception as e:
                    out[i] = _err(e)
            g0 = time.perf_counter()
            try:
                completions = engine.generate([r for _, r in reqs]) if reqs else []
            except Exception as e:
                completions = []
                for i, _ in reqs:
                    out[i] = _err(e)
            self.stats["judge_s"] += time.perf_counter() - g0
            for (i, _), c in zip(reqs, completions):
                try:
                    done = {"text": c.text, "logprobs": list(c.logprobs), "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
                    out[i] = ("ok", reward_value(name, call_reward(name, fn, items[i]["trajectory"], done)))
                except Exception as e:
                    out[i] = _err(e)
            self.stats["judge_calls"] += len(reqs)
            self.stats["judge_batches"] += int(bool(reqs))
            self.stats["judge_errors"] += sum(out[i][0] != "ok" for i in idx)
            self._count_local(name, len(idx), time.perf_counter() - t0)
        return out

    # -- serverless ---------------------------------------------------------------------------
    def _invoke(self, item: dict) -> dict:
        from rollart_dask.data.serverless import RewardError, invoke_reward

        t0 = time.perf_counter()
        try:
            out, st = invoke_reward(self.client, item["function"], item["trajectory"], retries=self.retries, timeout_s=self.timeout_s)
        except RewardError as e:
            self.stats["errors"] += 1
            self._count(e.stats, item["reward"], time.perf_counter() - t0)
            raise
        self._count(st, item["reward"], time.perf_counter() - t0)
        return reward_value(item["function"], out)

    def _count(self, st, name: str, seconds: float) -> None:
        if st is None:
            return
        self.stats["calls"] += 1
        self.stats["cold_starts"] += int(bool(st.cold_start))
        self.stats["throttles"] += st.throttles
        self.stats["retries"] += st.retries
        self.stats["billed_ms"] += float(st.billed_ms or 0)
        self._count_reward(name, 1, seconds)  # the invocation's wall time, as the caller waits it
        # the caller's busy time is waiting, not reward compute: billed duration is the capacity used
