"""The chaos suite, repeated: how often each scenario is survived, over fresh seeded schedules.

One `rollart chaos FLOW --scenario all` is one draw of each schedule (a fault mid-rollout lands a seeded
fraction of a second after its step). A scenario that survives one draw may not survive the next, so this
runs the whole suite ``--repeats`` times, seeds apart, and prints per scenario: runs completed out of
runs, the most samples lost in any run, the median slowdown against that repeat's fault-free baseline, the
most leaked envs / sandbox processes, and the errors of the runs that did not complete.

    python benchmarks/chaos.py --repeats 3                      # ~12 min on 2 cores
    python benchmarks/chaos.py --scenario trainer-worker-lost --repeats 5
    python benchmarks/chaos.py --repeats 1 --set rollout.max_trained_lag=1 \
        --scenario trainer-worker-restart,trainer-worker-restart-mid-update,trainer-worker-lost,scheduler-connection-drop

Per scenario it also prints the most any trained token lagged behind its trainer (``token_lag_max``, measured by the
trainer) and the samples the trainer dropped past ``rollout.max_trained_lag`` (0 when Get Batch kept the bound).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
from rich.table import Table

from rollart_dask.config import load_flow
from rollart_dask.observe import console
from rollart_dask.tools.chaos.runner import TINY
from rollart_dask.tools.chaos.scenarios import select
from rollart_dask.tools.chaos.suite import run_suite, slowdown


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--scenario", default="all", show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--steps", default=10, show_default=True)
@click.option("--out", default="runs/bench-chaos", show_default=True)
@click.option("--set", "overrides", multiple=True, help="a flow override (key=value) for every scenario's run; repeatable")
def main(flow: str, scenario: str, repeats: int, steps: int, out: str, overrides: tuple[str, ...]) -> None:
    base, scenarios = load_flow(flow), select(scenario)
    budget = tuple(b for b in TINY if not b.startswith("trainer.steps=")) + (f"trainer.steps={steps}", *overrides)
    by_name: dict[str, list[dict]] = {}
    for r in range(repeats):
        rows = run_suite(base, scenarios, Path(out) / f"repeat-{r}", seed=1000 * r, budget=budget, echo=console.print)
        for row in rows:
            comparable = row.get("completed") and rows[0].get("completed") and not row.get("own_workload")
            row["slowdown"] = slowdown(row, rows[0]) if comparable else None
            by_name.setdefault(row["scenario"], []).append(row)
    t = Table(title=f"chaos suite × {repeats}", show_lines=True)
    columns = ("scenario", "completed", "most samples lost", "median slowdown", "most leaked envs / processes", "trained lag max / dropped")
    for c in (*columns, "errors"):
        t.add_column(c, overflow="fold")
    for name, rows in by_name.items():
        slow = [r["slowdown"] for r in rows if r["slowdown"] is not None]
        t.add_row(
            name,
            f"{sum(bool(r.get('completed')) for r in rows)}/{len(rows)}",
            str(max((r.get("samples_lost", 0) for r in rows), default=0)),
            f"{statistics.median(slow):.2f}×" if slow else "–",
            f"{max((r.get('leaked_envs') or 0) for r in rows)} / {max(r.get('leaked_processes', 0) for r in rows)}",
            f"{max((r['token_lag_max'] for r in rows if r.get('token_lag_max') is not None), default='–')} / "
            f"{sum(r.get('counts', {}).get('samples_over_lag_dropped', 0) for r in rows)}",
            "; ".join(r["error"] for r in rows if r.get("error")) or "–",
        )
    console.print(t)
    (Path(out) / "repeats.json").write_text(json.dumps(by_name, indent=2, default=str))


if __name__ == "__main__":
    main()
