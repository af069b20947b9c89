"""The scheduler side: a SchedulerPlugin that keeps what runs publish and serves the page.

Runs publish with ``client.log_event(TOPIC, snapshot)``; the scheduler hands every event to its
plugins' ``log_event``, where snapshots are merged per run. The plugin is registered by the run
itself, so it has to be importable on the scheduler (``rollart_dask`` installed there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distributed.diagnostics.plugin import SchedulerPlugin

from rollart_dask.control.snapshot import TOPIC
from rollart_dask.serve.dashboard.names import PLUGIN

MAX_POINTS = 5000  # per series and run: a long run's page shows its most recent 5000 steps
MAX_RUNS = 8


@dataclass
class RunState:
    """One run as the page sees it: the latest snapshot's gauges and the merged series."""

    latest: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)  # step → {"t", "busy", "staleness"}
    syncs: dict = field(default_factory=dict)  # version → {"t", "suspend_s", "update_s", "recompute_kv_s"}
    evals: dict = field(default_factory=dict)  # version → {"t", "success": {task: x}}
    updated: float = 0.0

    def merge(self, snap: dict) -> None:
        self.latest = {k: v for k, v in snap.items() if k not in ("steps", "syncs", "evals")}
        for name, key in (("steps", "step"), ("syncs", "version"), ("evals", "version")):
            series = getattr(self, name)
            for row in snap.get(name) or ():
                series[row[key]] = row
            for k in sorted(series)[:-MAX_POINTS]:
                del series[k]
        self.updated = time.time()


def merge_event(runs: dict[str, RunState], msg) -> None:
    """Fold one published snapshot into ``runs`` (run id → RunState), keeping the newest MAX_RUNS."""
    if not isinstance(msg, dict) or "run" not in msg:
        return
    runs.setdefault(msg["run"], RunState()).merge(msg)
    for rid in sorted(runs, key=lambda r: runs[r].updated)[:-MAX_RUNS]:
        del runs[rid]


class RollartDashboard(SchedulerPlugin):
    name = PLUGIN
    idempotent = True  # a second run on the same scheduler keeps this plugin, its page and earlier runs

    def __init__(self):
        self.runs: dict[str, RunState] = {}
        self.app = None
        self.metrics = False  # the runs' rollart_* series on the scheduler's /metrics

    async def start(self, scheduler) -> None:
        from rollart_dask.serve.dashboard.page import add_page

        self.scheduler = scheduler
        # Registered while (or after) a run publishes: catch up from the scheduler's event log.
        for _, msg in scheduler.get_events(TOPIC):
            merge_event(self.runs, msg)
        try:  # (without prometheus_client Dask serves no /metrics either)
            from rollart_dask.serve.dashboard import prometheus
        except ImportError:
            prometheus = None
        if prometheus is not None and not self.metrics:
            prometheus.register(self.runs)
            self.metrics = True
        self.app = add_page(scheduler)  # raises, naming why, where the scheduler cannot serve it

    async def close(self) -> None:
        from rollart_dask.serve.dashboard.page import remove_page

        remove_page(getattr(self, "scheduler", None), self.app)
        if self.metrics:
            from rollart_dask.serve.dashboard import prometheus

            prometheus.unregister(self.runs)
            self.metrics = False

    def log_event(self, topic: str, msg) -> None:
        if topic == TOPIC:
            merge_event(self.runs, msg)

    def current(self) -> RunState | None:
        """The run that published last."""
        return max(self.runs.values(), key=lambda s: s.updated, default=None)
