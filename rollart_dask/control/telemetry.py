"""Telemetry beside the protocol: a watchdog for a run that makes no progress, the dashboard feed, and the
rollout figures of each step (pool busy fractions, tokens/s, reward service, stage latencies). None of it decides
anything the protocol does. (Workers that join or leave: control/membership.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from rollart_dask.control.buffer import SampleBuffer
from rollart_dask.control.snapshot import TOPIC
from rollart_dask.control.status import RunStatus
from rollart_dask.data import plugins, tasks
from rollart_dask.observe import console

PD_STATS = (
    "pd_prefill_requests",
    "pd_prefill_s",
    "pd_kv_bytes_out",
    "pd_decode_requests",
    "pd_decode_s",
    "pd_kv_bytes_in",
    "pd_reprefilled",
    "pd_emulated_prefill_s",
    "pd_emulated_kv_transfer_s",
    "pd_emulated_decode_s",
)


def pd_metrics(engine_stats: dict[str, dict]) -> dict:
    """rollout.pd totals since the run started over all engines (worker → engine stats): KV bytes shipped,
    requests and engine wall seconds of each phase, re-prefills; on the emulated engine also the modelled
    (emulated) seconds of prefill, KV transfer and decode, under ``emulated``."""
    tot = {k: 0 for k in PD_STATS}
    for st in engine_stats.values():
        for k in PD_STATS:
            tot[k] += st.get(k, 0)
    out = {
        "kv_bytes_shipped": tot["pd_kv_bytes_in"],
        "prefill_requests": tot["pd_prefill_requests"],
        "prefill_s": round(tot["pd_prefill_s"], 4),
        "decode_requests": tot["pd_decode_requests"],
        "decode_s": round(tot["pd_decode_s"], 4),
        "reprefilled": tot["pd_reprefilled"],
        "kv_bytes_per_request": tot["pd_kv_bytes_in"] / max(tot["pd_decode_requests"], 1),
    }
    if any(st.get("engine") == "emulated" for st in engine_stats.values()):  # EMULATED: modelled hardware seconds
        out["emulated"] = {
            "prefill_s": round(tot["pd_emulated_prefill_s"], 4),
            "kv_transfer_s": round(tot["pd_emulated_kv_transfer_s"], 4),
            "decode_s": round(tot["pd_emulated_decode_s"], 4),
        }
    return out


REWARD_TOTALS = ("calls", "throttles", "cold_starts", "retries", "errors")  # (per step in the rows; totals in the snapshot)


class Telemetry:
    """Given the run's status record, its buffer and a snapshot of it for the page, never the run itself; the services
    and the launcher once set-up has made them (``attach``)."""

    def __init__(self, cfg, status: RunStatus, buffer: SampleBuffer, out: Path, snapshot: Callable[[bool], dict]):
        self.cfg, self.status, self.buffer, self.out = cfg, status, buffer, out
        self.snapshot = snapshot  # final → the dashboard's view of the run (control/snapshot.py)
        self.services = self.launcher = None
        self.train_busy_s = 0.0  # trainer seconds since the last pool-busy sample
        self.engine_stats: dict[str, dict] = {}
        self.service_s: Counter = Counter()
        self._reward_stats: list[dict] = []
        self._busy_prev: dict | None = None
        self._t_prev = time.monotonic()
        self.tokens_trained = 0  # response tokens of every batch taken so far
        self.reward_totals: Counter = Counter()  # reward calls, throttles, cold starts, retries, errors since the run began

    def attach(self, services, launcher) -> None:
        self.services, self.launcher = services, launcher

    # -- background loops ---------------------------------------------------------------------------
    async def watchdog(self) -> None:
        """Report a run that makes no progress: what is in flight, where, and every coroutine's stack."""
        status, launcher = self.status, self.launcher
        limit = self.cfg.observe.watchdog_s
        while not launcher.stopping:
            await asyncio.sleep(min(5.0, limit / 4))
            idle = time.monotonic() - max(launcher.finished_at, status.progress_at)
            if idle <= limit:
                continue
            s = self.services
            where = Counter(s.poolmap.name(a) for a in s.em.where.values())
            msg = (
                f"watchdog: no progress for {idle:.0f}s — in flight by stage {dict(s.em.in_flight())}, "
                f"envs by worker {dict(where)}, suspended={s.proxy.suspended}, engines v{s.proxy.version}, policy v{status.published}, "
                f"buffer ready {self.buffer.ready()}/{self.cfg.rollout.batch_groups}, open calls {s.d.open_calls()}"
            )
            console.print(f"[red]{msg}[/red]")
            with (self.out / "watchdog.txt").open("a") as f:
                f.write(msg + "\n")
                for task in asyncio.all_tasks():
                    f.write(f"--- {task.get_name()}\n")
                    task.print_stack(limit=8, file=f)
            status.counts["watchdog_alerts"] += 1
            status.progressed()

    async def feed(self) -> None:
        """The dashboard snapshot to the scheduler about once a second (control/snapshot.py)."""
        while not self.launcher.stopping:
            await self.publish()
            await asyncio.sleep(1.0)

    async def publish(self, final: bool = False) -> None:
        """One snapshot; a failure is counted, never raised (the page never stops a run)."""
        try:
            await asyncio.wait_for(self.services.client.log_event(TOPIC, self.snapshot(final)), 10)
        except Exception:
            self.status.counts["dashboard_publish_failed"] += 1

    # -- per step -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Counters start now: the first step's busy fractions cover its own rollout."""
        self._busy_prev, _ = await self._pool_busy(None, 1.0)
        self._t_prev = time.monotonic()

    async def rollout_row(self, groups) -> dict:
        """What rollout did since the last step: pool busy fractions, tokens/s, reward service, call latencies."""
        s = self.services
        now = time.monotonic()
        dt = now - self._t_prev
        self._busy_prev, busy = await self._pool_busy(self._busy_prev, dt)
        tokens = sum(len(t.response_ids) for g in groups for tr in g.kept for t in tr.turns)
        self.tokens_trained += tokens
        row = {"reward": s.rewards.step_stats(self._reward_stats, dt, self._reward_slots())}
        self.reward_totals.update({k: row["reward"].get(k, 0) for k in REWARD_TOTALS})
        if self.cfg.rollout.pd:  # KV bytes shipped, prefill / decode engine seconds (totals so far)
            row["pd"] = pd_metrics(self.engine_stats)
        row.update(
            pool_busy=busy,
            tokens_per_s=tokens / max(dt, 1e-9),
            elapsed_s=now - self.status.t_start,
            buffer=dict(self.buffer.counts),
            futures=s.d.futures,
            calls=s.d.calls,
            reissued=s.proxy.reissued,
            mix=self.buffer.mix_at_take,
            stage_latency=s.d.drain_stats(),
            trajectory_s=self.launcher.drain_trajectory_s(),
            service_s=dict(self.service_s),
            rollout_tokens=self.tokens(),
            generate_pools=s.proxy.landed_by_task(),
        )
        self._t_prev = now
        return row

    def tokens(self) -> dict:
        """Response tokens since the run began: generated by the engines, trained, discarded (partials restarted after a
        Suspend), continued (partials a continuation went on from); wasted = not trained (restarted partials, aborted,
        evicted, redundant and failed trajectories, and what is still in flight) as a share of those generated."""
        t = self.services.proxy.tokens
        gen = t["generated"]
        return {
            "generated": gen,
            "trained": self.tokens_trained,
            "discarded": t["discarded"],
            "continued": t["continued"],
            "wasted_share": round(1 - self.tokens_trained / gen, 4) if gen else None,
        }

    async def _pool_busy(self, prev: dict | None, dt: float) -> tuple[dict, dict]:
        """Busy fraction per pool since the last call: service busy seconds / (wall × services in the pool)."""
        s = self.services
        try:
            stats = await asyncio.wait_for(s.client.run(tasks.service_stats), 30)
        except (asyncio.TimeoutError, OSError):  # a busy or departing worker: skip this sample, never the run
            self.status.counts["stats_timeouts"] += 1
            return prev or {}, {}
        busy: Counter = Counter()
        holders: Counter = Counter()
        flat = {}
        self._reward_stats = [services[plugins.REWARD] for services in stats.values() if plugins.REWARD in services]
        self.engine_stats = {addr: services[plugins.ENGINE] for addr, services in stats.items() if plugins.ENGINE in services}
        self.service_s: Counter = Counter()  # per stage: seconds the calls spent inside the services (vs. the caller's wall)
        for addr, services in stats.items():
            for service, st in services.items():
                pool = {plugins.ENVHOST: "CPU", plugins.REWARD: s.rewards.pool}.get(service) or s.proxy.pool_of.get(addr, "?")
                flat[(addr, service)] = st["busy_s"]
                busy[pool] += st["busy_s"] - (prev or {}).get((addr, service), 0.0)
                holders[pool] += 1
                for stage, key in (("generate", "request_s"), ("env-reset", "resets_s"), ("env-step", "steps_s")):
                    if key in st:
                        flat[(addr, service, key)] = st[key]
                        self.service_s[stage] += st[key] - (prev or {}).get((addr, service, key), 0.0)
        busy["TRAIN"], holders["TRAIN"], self.train_busy_s = self.train_busy_s, 1, 0.0
        return flat, {p: round(v / max(dt, 1e-9) / holders[p], 4) for p, v in busy.items()}

    def _reward_slots(self) -> int:
        """Local rewards scored at once: per REWARD worker, its task threads or the batches in flight to it,
        whichever is fewer (each batch is scored in turn); the utilisation divides by this capacity."""
        s, cfg = self.services, self.cfg
        if cfg.reward.mode != "local":
            return len(self._reward_stats)
        inflight = cfg.rollout.coalesce_inflight if cfg.rollout.coalesce else 10**9
        return sum(min(s.poolmap.workers[a].get("nthreads", 1), inflight) for a in s.poolmap.members("REWARD")) or 1
