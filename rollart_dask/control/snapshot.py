"""The dashboard feed: the snapshot a run publishes on the scheduler's ``TOPIC`` about once a second
(``client.log_event``; the RollArt page in serve/dashboard reads it). A pure function of the run's
public state (no I/O), small and msgpack-serialisable (str keys, lists, numbers) as ``log_event`` needs.

Series (steps, weight syncs, evaluations) go as their last ``TAIL`` entries, each keyed (step,
version): the scheduler side merges them by key, so a lost or repeated snapshot loses nothing and
each message stays a few kB however long the run is.
"""

from __future__ import annotations

import time

from rollart_dask.algo.heldout import is_complete
from rollart_dask.control.buffer import LAG_PARTS

TOPIC = "rollart"  # the scheduler event topic the dashboard page and notebooks read
TAIL = 32
COUNTS = ("aborted_stale", "evicted_stale", "redundant_dropped", "failed", "relaunched", "groups_dropped", "finished")


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def _mix_gap(mix: dict | None) -> dict:
    """Per task, trained share − launched share since the run began, in percentage points (buffer.mix)."""
    if not mix:
        return {}
    launched, trained = mix.get("launched", {}), mix.get("trained", {})
    return {t: _r(100 * (trained.get(t, 0.0) - launched.get(t, 0.0)), 2) for t in sorted(set(launched) | set(trained))}


def _by_version(hist: dict) -> list[int]:
    """{"0": 5, "2": 1} → [5, 0, 1]: a histogram over versions as a list (each message stays small)."""
    counts = {int(k): int(v) for k, v in hist.items()}
    return [counts.get(x, 0) for x in range(max(counts, default=-1) + 1)]


def build_snapshot(run, now: float | None = None, final: bool = False) -> dict:
    """The dashboard's view of ``run`` (a control.run.Run after set-up) at monotonic time ``now``."""
    now = time.monotonic() if now is None else now
    cfg = run.cfg
    buf = run.buffer.counts
    counts = {k: int(buf.get(k, 0)) for k in COUNTS}
    counts["failed"] += int(buf.get("worker_lost", 0))  # failed for want of its worker (env or engine): a failure too
    steps = [r for r in run.metrics.rows if r.get("kind") == "step"][-TAIL:]
    return {
        "run": run.run_id,
        "name": cfg.name,
        "mode": cfg.rollout.mode,
        "alpha": cfg.rollout.alpha,
        "status": "ended" if final else run.state,
        "t": _r(now - run.status.t_start, 2),
        "steps_target": cfg.trainer.steps,
        "version": run.engine_version,  # the engines' policy version
        "published": run.published,  # the trainer's
        "inflight": dict(run.in_flight()),
        "counts": counts,
        # monotonic totals since the run began (Prometheus counters: serve/dashboard/prometheus.py)
        "totals": {
            "generate_calls": int(run.services.proxy.requests),
            **{f"reward_{k}": int(v) for k, v in run.telemetry.reward_totals.items()},
        },
        "steps": [
            {
                "step": int(r["step"]),
                "t": _r(r.get("elapsed_s", 0.0), 2),
                "busy": {p: _r(v) for p, v in (r.get("pool_busy") or {}).items()},
                "staleness": {str(k): int(v) for k, v in (r.get("staleness") or {}).items()},
                # its two parts (control/buffer.py: SampleBuffer.lag): [in flight, in the queue], each counts by versions 0, 1, …
                "lag": [_by_version((r.get("lag_hist") or {}).get(part) or {}) for part in LAG_PARTS],
                "mix": _mix_gap(r.get("mix")),
            }
            for r in steps
        ],
        # weight syncs of set-up (warm start, restore) have t < 0: they happened before the run's clock
        "syncs": [
            {
                "t": _r(s["at"] - run.status.t_start, 2),
                "from": s["from"],
                "version": s["version"],
                **{k: _r(s.get(k, 0.0)) for k in ("suspend_s", "update_s", "recompute_kv_s")},
            }
            for s in run.syncs[-TAIL:]
        ],
        "evals": [
            {
                "version": int(e["version"]),
                "t": _r(e.get("elapsed_s", 0.0), 2),
                # an incomplete evaluation is no score: its failed calls instead (control/evaluation.py)
                "success": {task: _r(r["success"]) for task, r in (e.get("eval") or {}).items() if is_complete(r)},
                "failed": {task: int(r["failed_calls"]) for task, r in (e.get("eval") or {}).items() if not is_complete(r)},
            }
            for e in run.history[-TAIL:]
        ],
    }
