"""Reward plane set-up: where rewards run (``reward.mode``) and, when serverless, the Lambda
functions behind them — on AWS, on an endpoint given by URL, or on a local endpoint started for
the run on 127.0.0.1 (by ``start_endpoint``, which the embedded default passes in: the local Lambda
endpoint is a tool around the runtime, serve/lambda_local).

Stateful rewards (a reward module with ``NEEDS_ENGINE = True``, e.g. the LLM judge) need an
inference engine: they stay on the REWARD pool in both modes and are never deployed as functions;
the runners there load the judge engine (``reward.judge_model``). Where each reward runs is printed
at start and reported with every step's reward metrics (``rewards.<name>.where``).

Utilisation of reward capacity, as the paper compares it: ``local`` = busy time / reserved
time of the dedicated worker; ``serverless`` = billed duration / lifetime of the execution
environments that were provisioned (what a serverless platform keeps warm for the run: the local
endpoint retires an idle one after ``reward.keep_warm_s``, in emulated seconds in an emulated flow).
``paid_utilisation`` is the share of what the run pays for that scored rewards: local, the same
(the worker is paid for while reserved); serverless, handler time / billed time (on-demand billing
charges invocations only, cold-start init included). The REWARD workers that host stateful rewards
in a serverless run report their own utilisation (``local``: busy time / wall time).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Callable

from rollart_dask.config import FlowConfig
from rollart_dask.observe import console
from rollart_dask.resource.pools import REWARD_POOL, PoolMap


def function_name(prefix: str, reward: str) -> str:
    """A valid Lambda function name (letters, digits, - and _; at most 64)."""
    return (prefix + re.sub(r"[^A-Za-z0-9_-]+", "-", reward))[:64]


class RewardPlane:
    def __init__(self, cfg: FlowConfig, out_dir: Path, start_endpoint: Callable | None = None):
        self.cfg, self.out, self.start_endpoint = cfg, out_dir, start_endpoint
        self.mode = cfg.reward.mode
        self.pool = REWARD_POOL[self.mode]
        self.functions: dict[str, str] = {}  # reward name → function name
        self.endpoint = None  # a local endpoint started for this run
        self.url: str | None = None
        self._prev: dict = {}
        self._prev_endpoint = (0.0, 0.0, 0.0)  # (environment lifetime s, billed s, handler s) at the last step
        self.stateful: list[str] = []  # rewards that need an engine: always on the REWARD pool
        self.pinned: list[str] = []  # rewards declared stateless=False: always on the REWARD pool, scored in-process
        self.where: dict[str, str] = {}  # reward name → where it runs
        self.judge_model: str | None = None  # the judge engine's model, when a stateful reward is used
        self._t_prev: float | None = None  # when the counters' window began (start, then each step_stats)

    def _kept_local(self) -> tuple[list[str], list[str]]:
        """(stateful: need an engine, pinned: declared ``@rollart_dask.reward(stateless=False)``): both stay on REWARD."""
        from rollart_dask.registry import get_reward, stateful_reward

        stateful, pinned = [], []
        for reward in sorted({t.reward for t in self.cfg.tasks}):
            try:
                if stateful_reward(reward) is not None:
                    stateful.append(reward)
                elif getattr(get_reward(reward), "__rollart__", {}).get("stateless") is False:
                    pinned.append(reward)
            except (ImportError, KeyError, AttributeError):
                pass  # not importable here: a plain reward's own path reports it
        return stateful, pinned

    @property
    def kept_local(self) -> list[str]:
        """The rewards whose calls go to the REWARD pool whatever the mode."""
        return [*self.stateful, *self.pinned]

    def _judge_spec(self) -> dict:
        r = self.cfg.reward
        model = r.judge_model
        if self.stateful and model == "policy":
            from rollart_dask.models.prepare import prepare_model  # the run's own model directory (built once, cached)

            model = str(prepare_model(self.cfg))
        self.judge_model = model if self.stateful else None
        return {
            "stateful": list(self.stateful),
            "pinned": list(self.pinned),
            "judge_model": model,
            "judge_max_batch": r.judge_max_batch,
            "seed": self.cfg.seed,
        }

    async def _check_reward_pool(self) -> None:
        """Stateful rewards of a serverless run need a REWARD worker: an error naming the pool, not a stuck call."""
        try:
            from distributed import default_client

            client = default_client()
        except (ImportError, ValueError):
            return
        info = await client.scheduler.identity()
        PoolMap.from_scheduler_info(info).validate({"REWARD": f"stateful reward(s) {', '.join(self.kept_local)}: they stay local"})

    def _announce(self) -> None:
        for reward in self.stateful:
            self.where[reward] = "REWARD (stateful: judge engine)"
            console.print(
                f"reward {reward}: stateful (needs an engine) — runs on the REWARD pool with judge model "
                f"{self.cfg.reward.judge_model}"
                + (f" ({self.judge_model})" if self.judge_model != self.cfg.reward.judge_model else "")
                + (", not deployed as a Lambda function" if self.mode == "serverless" else "")
            )
        for reward in self.pinned:
            self.where[reward] = "REWARD (declared stateful)"
            console.print(
                f"reward {reward}: declared stateful (@rollart_dask.reward(stateless=False)) — runs on the REWARD pool"
                + (", not deployed as a Lambda function" if self.mode == "serverless" else "")
            )

    async def start(self) -> dict:
        """Start/deploy what the mode needs; returns the spec of the reward runner."""
        r = self.cfg.reward
        self._t_prev = time.monotonic()  # the runners, registered after this, count from zero
        self.stateful, self.pinned = self._kept_local()
        judge = self._judge_spec()
        self._announce()
        if self.mode == "local":
            self.where.update({t.reward: "REWARD" for t in self.cfg.tasks if t.reward not in self.where})
            return {"mode": "local", **judge}
        if self.kept_local:
            await self._check_reward_pool()
        spec = {
            "mode": "serverless",
            "endpoint_url": "aws",
            "region": r.region,
            "retries": r.invoke_retries,
            "timeout_s": self.cfg.rollout.reward_timeout_s,
            "threads": r.invoke_threads,
            **judge,
        }
        plain = sorted({t.reward for t in self.cfg.tasks} - set(self.kept_local))
        if not plain:
            console.print("reward: every reward of this flow is stateful: no Lambda endpoint is needed")
            return spec
        from rollart_dask.data.serverless import deploy, make_lambda_client

        if r.endpoint_url is None:
            if self.start_endpoint is None:
                raise RuntimeError(
                    "reward.mode=serverless without reward.endpoint_url needs a local endpoint started for the run: "
                    "run the flow through rollart_dask.entry.api.run_flow (or `rollart run`), or set reward.endpoint_url"
                )
            self.endpoint = await asyncio.to_thread(
                self.start_endpoint,
                host="127.0.0.1",
                port=0,
                state_dir=str(self.out / "lambda"),
                keep_warm_s=self.keep_warm_wall_s(),
                mode="process",
                faults=r.endpoint_faults.model_dump() if r.endpoint_faults else None,
            )
            self.url = self.endpoint.url
            console.print(f"reward endpoint (local, Lambda API): {self.url}")
        else:
            self.url = None if r.endpoint_url == "aws" else r.endpoint_url
        token = self.endpoint.token if self.endpoint is not None else None  # (else $ROLLART_LAMBDA_TOKEN, or AWS credentials)
        client = make_lambda_client(self.url, region=r.region, token=token)
        for reward in plain:
            name = function_name(r.function_prefix, reward)
            if r.deploy:
                out = await asyncio.to_thread(
                    deploy,
                    name,
                    reward,
                    client,
                    role_arn=r.role_arn,
                    timeout=r.function_timeout_s,
                    memory=r.memory_mb,
                    concurrency=r.concurrency,
                )
                console.print(f"reward {reward}: {out['action']} {out['function_arn']}")
            self.functions[reward] = name
            self.where[reward] = f"SERVERLESS (Lambda {name})"
        return dict(spec, endpoint_url=self.url or "aws", **({"token": token} if token else {}))

    def keep_warm_wall_s(self) -> float:
        """``reward.keep_warm_s`` on the wall clock: an emulated flow states it in emulated seconds (its rewards
        take emulated time too), so a platform's reclaim policy keeps its proportion to a step."""
        e = self.cfg.emulation
        return self.cfg.reward.keep_warm_s * (e.time_scale if self.cfg.emulated and e.time_scale > 0 else 1.0)

    def step_stats(self, runner_stats: list[dict], wall_s: float, n_reserved: int) -> dict:
        """Per-step reward metrics from the reward runners' cumulative counters (deltas since the last call).

        Busy fractions divide by the time since the last call (since start for the first), the window the
        counter deltas cover; ``wall_s`` is used only when the plane was not started."""
        now = time.monotonic()
        if self._t_prev is not None:
            wall_s, self._t_prev = now - self._t_prev, now
        total: dict[str, float] = {}
        gauges: dict[str, float] = {}  # n_*: how many runners have a role, not counters
        for st in runner_stats:
            for k, v in st.items():
                into = gauges if k.startswith("n_") else total
                into[k] = into.get(k, 0.0) + v
        delta = {k: v - self._prev.get(k, 0.0) for k, v in total.items()}
        self._prev = total
        out = {"mode": self.mode, "calls": int(delta.get("calls", 0))}
        names = sorted(set(self.where) | {k.split(":", 1)[1] for k in delta if k.startswith("calls:")})
        out["rewards"] = {}
        for name in names:
            n = int(delta.get(f"calls:{name}", 0))
            row = {"where": self.where.get(name, "?"), "calls": n}
            if n:  # local: compute time per call (a judge batch shared among its items); serverless: invocation wall time
                row["latency_ms"] = round(1000 * delta.get(f"time_s:{name}", 0.0) / n, 2)
            out["rewards"][name] = row
        if self.stateful or delta.get("judge_calls", 0):
            batches = int(delta.get("judge_batches", 0))
            out["judge"] = {
                "model": self.judge_model,
                "calls": int(delta.get("judge_calls", 0)),
                "batches": batches,
                "errors": int(delta.get("judge_errors", 0)),
                "batch_ms": round(1000 * delta.get("judge_s", 0.0) / batches, 2) if batches else 0.0,
            }
        if self.mode == "local":
            out["utilisation"] = out["paid_utilisation"] = round(delta.get("busy_s", 0.0) / max(wall_s * max(n_reserved, 1), 1e-9), 4)
            return out
        out.update(
            cold_starts=int(delta.get("cold_starts", 0)),
            throttles=int(delta.get("throttles", 0)),
            retries=int(delta.get("retries", 0)),
            errors=int(delta.get("errors", 0)),
            billed_s=round(delta.get("billed_ms", 0.0) / 1000, 4),
        )
        if self.stateful:  # the REWARD workers hosting stateful rewards: their own busy fraction
            hosts = int(gauges.get("n_local", 0))
            out["local"] = {
                "pool": "REWARD",
                "workers": hosts,
                "calls": int(delta.get("local_calls", 0)),
                "busy_s": round(delta.get("busy_s", 0.0), 4),
                "utilisation": round(delta.get("busy_s", 0.0) / max(wall_s * max(hosts, 1), 1e-9), 4),
            }
        if self.endpoint is not None:
            try:
                fns = self.endpoint.stats().get("functions", {})
            except OSError as e:  # the endpoint is down (restarting): its figures wait for the next step; the run goes on
                out["endpoint_unreachable"] = f"{type(e).__name__}: {e}"
                return out
            totals = tuple(sum(f.get(k, 0.0) for f in fns.values()) for k in ("alive_s", "billed_ms", "duration_ms"))
            totals = (totals[0], totals[1] / 1000, totals[2] / 1000)
            if any(x < p for x, p in zip(totals, self._prev_endpoint)):  # a restarted endpoint counts from zero again
                self._prev_endpoint = (0.0, 0.0, 0.0)
            d_alive, d_billed, d_ran = (x - p for x, p in zip(totals, self._prev_endpoint))
            self._prev_endpoint = totals
            out["utilisation"] = round(d_billed / d_alive, 4) if d_alive > 0 else 0.0
            out["paid_utilisation"] = round(d_ran / d_billed, 4) if d_billed > 0 else 0.0
            out["environments"] = sum(f.get("environments", 0) for f in fns.values())
        return out

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
            self.endpoint = None
