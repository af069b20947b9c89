"""Asynchrony without bias on real learning: eager admission at α ∈ {1, 4} × trainer.correction ∈ {none, tis, decoupled}.

Every cell is the same flow (default flows/quickstart.yaml: FrozenLake learned from scratch), seeds and wall budget, run
one after the other in this process, each on a fresh embedded cluster, with ``rollout.partial`` continue; one more cell
runs the α=4 tis cell with ``restart`` to set the wasted tokens of the two side by side. Prints one table: time to
held-out success ≥ 0.8 and ≥ 0.9, the best and last held-out, steps, the response tokens generated / trained /
discarded / continued and the share wasted (generated, never trained), the off-policy figures (token lag behind the
trainer, IS weights truncated or dropped). Writes results.json and heldout.png (held-out success over time per cell).

    python benchmarks/staleness_grid.py                                   # full: 12 min per cell, 7 cells (~90 min)
    python benchmarks/staleness_grid.py --alpha 4 --correction tis --minutes 2   # one cell, a quick look
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

from rollart_dask.algo.heldout import is_complete
from rollart_dask.config import load_flow
from rollart_dask.entry.api import run_sync
from rollart_dask.observe import console


def first_reaching(rows: list[dict], target: float) -> tuple[float | None, int | None]:
    """(elapsed seconds, version) of the first held-out evaluation whose mean success over tasks reaches ``target``."""
    for r in rows:
        if (
            r["kind"] == "eval"
            and r["eval"]
            and all(map(is_complete, r["eval"].values()))
            and statistics.mean(t["success"] for t in r["eval"].values()) >= target
        ):
            return r["elapsed_s"], r["version"]
    return None, None


def cell_result(rows: list[dict], res: dict) -> dict:
    evals = [r for r in rows if r["kind"] == "eval" and r["eval"] and all(map(is_complete, r["eval"].values()))]  # (incomplete: no score)
    steps = [r for r in rows if r["kind"] == "step"]
    held = [(r["elapsed_s"], statistics.mean(t["success"] for t in r["eval"].values())) for r in evals]
    t8, v8 = first_reaching(rows, 0.8)
    t9, v9 = first_reaching(rows, 0.9)

    def mean_of(key: str) -> float | None:
        xs = [r[key] for r in steps if r.get(key) is not None]
        return statistics.mean(xs) if xs else None

    return {
        "time_to_0.8_s": t8,
        "version_at_0.8": v8,
        "time_to_0.9_s": t9,
        "version_at_0.9": v9,
        "best": max(h for _, h in held),
        "last": held[-1][1],
        "steps": res["steps"],
        "tokens": res["rollout_tokens"],
        "token_lag_mean": mean_of("token_lag_mean"),
        "is_truncated": mean_of("is_truncated"),
        "is_dropped": mean_of("is_dropped"),
        "is_weight_p99": mean_of("is_weight_p99"),
        "aborted_stale": res["counts"].get("aborted_stale", 0),
        "evicted_stale": res["counts"].get("evicted_stale", 0),
        "heldout": held,
    }


def _s(x: float | None) -> str:
    return f"{x:.0f} s" if x is not None else "not reached"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return format(x, fmt) if x is not None else "—"


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--minutes", default=12.0, show_default=True, help="training budget per cell")
@click.option("--alpha", "alphas", multiple=True, type=int, help="staleness bounds (default 1 and 4)")
@click.option(
    "--correction",
    "corrections",
    multiple=True,
    type=click.Choice(["none", "tis", "decoupled"]),
    help="off-policy corrections (default all three)",
)
@click.option(
    "--restart-cell/--no-restart-cell",
    default=True,
    show_default=True,
    help="also run the largest α with tis (else the first correction) and rollout.partial=restart: wasted tokens of "
    "restart beside continue",
)
@click.option("--out", default="runs/bench-staleness-grid", show_default=True)
@click.option("--set", "overrides", multiple=True)
def main(flow, minutes, alphas, corrections, restart_cell, out, overrides):
    alphas, corrections = alphas or (1, 4), corrections or ("none", "tis", "decoupled")
    cells = [(a, c, "continue") for a in alphas for c in corrections]
    if restart_cell:
        a = max(alphas)
        c = "tis" if "tis" in corrections else corrections[0]
        cells.append((a, c, "restart"))
    results = {}
    for alpha, correction, partial in cells:
        name = f"α={alpha} {correction} {partial}"
        cfg = load_flow(
            flow,
            [
                "rollout.mode=rollart",
                "rollout.admission=eager",
                f"rollout.alpha={alpha}",
                f"trainer.correction={correction}",
                f"rollout.partial={partial}",
                f"trainer.max_minutes={minutes}",
                "trainer.steps=100000",
                "observe.progress=false",
                *overrides,
            ],
        )
        out_dir = Path(out) / name.replace("=", "").replace(" ", "_")
        console.print(f"[bold]{name}[/bold]")
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)  # a run appends to its directory's log: read this run's rows only
        res = run_sync(cfg, out_dir)
        rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").open()]
        results[name] = {"alpha": alpha, "correction": correction, "partial": partial, **cell_result(rows, res)}
    from rich.table import Table

    table = Table(title=f"eager admission, α × trainer.correction ({flow}, {minutes} min per cell)")
    for col in (
        "cell",
        "to 0.8",
        "to 0.9",
        "best / last held-out",
        "steps",
        "tokens generated / trained",
        "discarded / continued",
        "wasted",
        "token lag",
        "IS truncated / dropped",
        "stale aborted / evicted",
    ):
        table.add_column(col)
    for name, r in results.items():
        t = r["tokens"]
        table.add_row(
            name,
            _s(r["time_to_0.8_s"]),
            _s(r["time_to_0.9_s"]),
            f"{r['best']:.3f} / {r['last']:.3f}",
            str(r["steps"]),
            f"{t['generated']} / {t['trained']}",
            f"{t['discarded']} / {t['continued']}",
            _f(t["wasted_share"], ".1%"),
            _f(r["token_lag_mean"], ".2f"),
            f"{_f(r['is_truncated'], '.2%')} / {_f(r['is_dropped'], '.2%')}",
            f"{r['aborted_stale']} / {r['evicted_stale']}",
        )
    console.print(table)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2))
    _plot(results, Path(out) / "heldout.png")


def _plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for name, r in results.items():
        ax.plot(
            [t / 60 for t, _ in r["heldout"]],
            [h for _, h in r["heldout"]],
            marker="o",
            ms=3,
            label=name,
            linestyle="--" if r["partial"] == "restart" else "-",
        )
    ax.axhline(0.8, color="grey", lw=0.8)
    ax.axhline(0.9, color="grey", lw=0.8, linestyle=":")
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("held-out success")
    ax.set_title("held-out success over time: eager α × off-policy correction")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
