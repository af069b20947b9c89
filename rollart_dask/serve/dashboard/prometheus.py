"""The runs' live figures as Prometheus series (``rollart_*``), served by the Dask scheduler's own ``/metrics``.

The dashboard plugin (plugin.py) already holds each run's latest snapshot on the scheduler; this collector,
registered in the scheduler process's Prometheus registry beside Dask's own, turns them into series at
every scrape. Each series is labelled with the run id and the flow's name; counters are the run's totals
since it began (Prometheus's ``rate()`` gives turns/s). deploy/monitoring holds a scrape example and a
Grafana dashboard of these series.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LABELS = ["run", "flow"]
REWARD = {
    "calls": "reward invocations",
    "throttles": "reward invocations throttled (429)",
    "cold_starts": "reward cold starts",
    "retries": "reward invocations retried",
    "errors": "reward invocations that failed",
}


class RollartCollector:
    """Yields the rollart_* families from every source (run id → plugin.RunState: one per scheduler plugin in this process),
    read at scrape time."""

    def __init__(self):
        self.sources: list[dict] = []

    def describe(self):  # (registering calls collect() otherwise, before any run published)
        return []

    def collect(self):
        g = {
            name: GaugeMetricFamily(f"rollart_{name}", doc, labels=LABELS + extra)
            for name, doc, extra in (
                ("up", "1 while the run goes on, 0 once it ended", ["status"]),
                ("version", "policy version on the engines", []),
                ("published_version", "policy version the trainer published", []),
                ("steps_target", "training steps the run was started for", []),
                ("trajectories_in_flight", "trajectories in flight by stage", ["stage"]),
                ("staleness_samples", "trajectories of the last trained batch by staleness (versions behind)", ["staleness"]),
                ("pool_busy", "busy fraction of each pool over the last step", ["pool"]),
                ("held_out_success", "held-out success of the last evaluation (none while it is incomplete)", ["task"]),
                ("held_out_failed_calls", "held-out seeds whose eval calls failed in the last evaluation, when it is incomplete", ["task"]),
                ("held_out_version", "policy version of the last evaluation", []),
                ("mix_shift_pp", "trained share - launched share of each task since the run began, percentage points", ["task"]),
            )
        }
        c = {
            "trajectories": CounterMetricFamily(
                "rollart_trajectories", "trajectories and groups by outcome since the run began", labels=LABELS + ["outcome"]
            ),
            "turns": CounterMetricFamily(
                "rollart_turns", "generate calls (turns, re-issued ones included) since the run began", labels=LABELS
            ),
            **{k: CounterMetricFamily(f"rollart_reward_{k}", doc + " since the run began", labels=LABELS) for k, doc in REWARD.items()},
        }
        for rid, state in [item for runs in list(self.sources) for item in list(runs.items())]:
            s = state.latest
            if not s:
                continue
            base = [rid, str(s.get("name", ""))]
            status = str(s.get("status", ""))
            g["up"].add_metric(base + [status], 0.0 if status == "ended" else 1.0)
            g["version"].add_metric(base, s.get("version", 0))
            g["published_version"].add_metric(base, s.get("published", 0))
            g["steps_target"].add_metric(base, s.get("steps_target", 0))
            for stage, n in (s.get("inflight") or {}).items():
                g["trajectories_in_flight"].add_metric(base + [stage], n)
            for outcome, n in (s.get("counts") or {}).items():
                c["trajectories"].add_metric(base + [outcome], n)
            totals = s.get("totals") or {}
            c["turns"].add_metric(base, totals.get("generate_calls", 0))
            for k in REWARD:
                c[k].add_metric(base, totals.get(f"reward_{k}", 0))
            if state.steps:
                last = state.steps[max(state.steps)]
                for k, n in (last.get("staleness") or {}).items():
                    g["staleness_samples"].add_metric(base + [str(k)], n)
                for pool, busy in (last.get("busy") or {}).items():
                    g["pool_busy"].add_metric(base + [pool], busy)
                for task, pp in (last.get("mix") or {}).items():
                    g["mix_shift_pp"].add_metric(base + [task], pp)
            if state.evals:
                last = state.evals[max(state.evals)]
                g["held_out_version"].add_metric(base, last.get("version", 0))
                failed = last.get("failed") or {}
                for task, x in (last.get("success") or {}).items():
                    if task not in failed:  # (the snapshot already leaves an incomplete evaluation's success out)
                        g["held_out_success"].add_metric(base + [task], x)
                for task, n in failed.items():
                    g["held_out_failed_calls"].add_metric(base + [task], n)
        yield from g.values()
        yield from c.values()


_COLLECTOR = RollartCollector()  # one in the process's registry, whatever the number of schedulers it holds


def register(runs: dict) -> None:
    """Serve ``runs`` (a plugin's run id → RunState) on the /metrics of this process's scheduler(s)."""
    from prometheus_client import REGISTRY

    if not _COLLECTOR.sources:
        REGISTRY.register(_COLLECTOR)
    _COLLECTOR.sources.append(runs)


def unregister(runs: dict) -> None:
    from prometheus_client import REGISTRY

    _COLLECTOR.sources[:] = [r for r in _COLLECTOR.sources if r is not runs]
    if not _COLLECTOR.sources:
        try:
            REGISTRY.unregister(_COLLECTOR)
        except KeyError:  # (never registered)
            pass
