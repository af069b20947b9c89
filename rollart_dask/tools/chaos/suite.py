"""The whole suite: the baseline first (each slowdown is against it), then every scenario, one fresh run
each (on one cluster shared by the scenarios that leave it as found); results.json and the table (``rich`` for the terminal, Markdown for the README)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from rich.table import Table

from rollart_dask.config import FlowConfig
from rollart_dask.tools.chaos.runner import TINY, run_scenario, shared_cluster
from rollart_dask.tools.chaos.scenarios import Scenario

COLUMNS = (
    "scenario",
    "faults injected",
    "run completed",
    "samples lost",
    "steps redone",
    "slowdown",
    "leaked envs / processes / containers",
)


def run_suite(
    base: FlowConfig,
    scenarios: list[Scenario],
    out: Path,
    seed: int = 0,
    budget: tuple[str, ...] = TINY,
    echo=print,
    share_cluster: bool = True,
) -> list[dict]:
    """Each scenario a fresh run; those that leave the cluster as found on one cluster started for them all (unless
    ``share_cluster`` is False), the others each on its own embedded cluster."""
    rows = []
    sharing = share_cluster and any(s.can_share_cluster for s in scenarios)
    with shared_cluster(base) if sharing else nullcontext() as scheduler:
        for i, scenario in enumerate(scenarios):
            where = "the shared cluster" if scheduler and scenario.can_share_cluster else "its own cluster"
            echo(f"chaos [{i + 1}/{len(scenarios)}] {scenario.name} on {where}: {scenario.description}")
            row = run_scenario(base, scenario, out / scenario.name, seed=seed + i, budget=budget, scheduler=scheduler)
            rows.append(row)
            echo("  " + " | ".join(cells(row, rows[0])[1:]))
            (out / "results.json").write_text(json.dumps(rows, indent=2, default=str))
    return rows


def cells(row: dict, baseline: dict) -> list[str]:
    faults = "; ".join(row.get("faults") or []) or "none"
    if row.get("emulated"):
        faults = f"{faults if faults != 'none' else ''}{'; ' if faults != 'none' else ''}EMULATED {row['emulated']}"
    if row.get("inject_errors"):
        faults += f" (not injected: {'; '.join(row['inject_errors'])})"
    done = "yes" if row.get("completed") else f"no: {row.get('error', '')}"
    slow = f"{slowdown(row, baseline):.2f}×" if row.get("completed") and baseline.get("completed") else "–"
    if row.get("own_workload"):
        slow = "– (another task)"
    leaks = " / ".join(
        "–" if v is None else str(v) for v in (row.get("leaked_envs"), row.get("leaked_processes"), row.get("leaked_containers"))
    )
    lost = str(row["samples_lost"]) if "samples_lost" in row else "–"
    return [row["scenario"], faults, done, lost, str(row.get("steps_redone", 0)), slow, leaks]


def slowdown(row: dict, baseline: dict) -> float:
    """Seconds per planned step against the fault-free run's (a scenario that must outlast its faults runs more steps)."""
    per_step = lambda r: r["elapsed_s"] / r.get("steps_planned", 1)  # noqa: E731
    return per_step(row) / per_step(baseline)


def table(rows: list[dict]) -> Table:
    t = Table(title="chaos suite", show_lines=True)
    for c in COLUMNS:
        t.add_column(c, overflow="fold")
    for row in rows:
        t.add_row(*cells(row, rows[0]))
    return t


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(row, rows[0])) + " |" for row in rows]
    return "\n".join(lines) + "\n"
