"""Weight transfer: the Dask-native store vs the Mooncake store, side by side in one command.

The same flow (default: the quickstart with a larger model, so that a version is tens of MB,
and affinity auto, so that every engine pulls) runs once per store on a fresh embedded
cluster; the Mooncake run starts and stops its own mooncake_master. Prints, per store: bytes
per version, buckets, publish time on the trainer, pull time (published → staged on every
engine), the transfer (Train done → staged everywhere), what the step loop still waited for
before Suspend (rollout and the next Train go on meanwhile), the share of the transfer done
before the loop needed it, the swap itself (the only time rollout is suspended for new weights)
and seconds per step; and the ratio of the two stores.

    python benchmarks/weight_stores.py                 # ~6 min on 2 cores
    python benchmarks/weight_stores.py --steps 3 --set model.hidden_size=128 --set model.layers=2   # a quick look
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from rollart_dask.entry.api import run_sync
from rollart_dask.config import load_flow
from rollart_dask.observe import console

STORES = ("dask", "mooncake")
LARGER_MODEL = ["model.hidden_size=384", "model.layers=6", "model.heads=6", "model.intermediate_size=1536",
                "tasks.frozenlake.affinity=auto", "rollout.batch_groups=4", "weights.bucket_mb=16"]
COLUMNS = (("MiB/version", "bytes", lambda v: f"{v / 2**20:.1f}"), ("buckets", "buckets", str), ("engines", "engines", str),
           ("publish s", "publish_s", "{:.3f}".format), ("pull s", "pull_s", "{:.3f}".format), ("transfer s", "transfer_s", "{:.3f}".format),
           ("loop waited s", "waited_s", "{:.3f}".format), ("hidden", "hidden_fraction", "{:.0%}".format),
           ("swap s (rollout suspended)", "swap_s", "{:.3f}".format), ("s/step", "s_per_step", "{:.2f}".format))


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--steps", default=6, show_default=True, help="training steps per store")
@click.option("--out", default="runs/bench-weight-stores", show_default=True)
@click.option("--set", "overrides", multiple=True, help="flow overrides after the benchmark's own (key=value)")
def main(flow, steps, out, overrides):
    results = {}
    for store in STORES:
        cfg = load_flow(flow, [*LARGER_MODEL, f"weights.store={store}", f"trainer.steps={steps}", "trainer.max_minutes=null",
                               "eval.every=0", "eval.seeds=20", "observe.progress=false", *overrides])
        console.print(f"[bold]weights.store={store}[/bold]: {steps} steps of {flow}")
        run_dir = Path(out) / store
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: one run per directory
        res = run_sync(cfg, run_dir)
        swaps = [r["update_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == "step" and "weights" in r][1:]
        results[store] = {**res["weights"], "swap_s": sum(swaps) / max(len(swaps), 1), "steps": res["steps"],
                          "s_per_step": res["elapsed_s"] / max(res["steps"], 1)}
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weight transfer per version, mean over each run's updates after the first ({flow}, {steps} steps)")
    table.add_column("store")
    for title, *_ in COLUMNS:
        table.add_column(title, justify="right")
    for store, r in results.items():
        table.add_row(store, *(fmt(r[key]) for _, key, fmt in COLUMNS))
    Console(width=170).print(table)  # all columns, in a log file too
    d, m = results["dask"], results["mooncake"]
    console.print(f"mooncake / dask: transfer {m['transfer_s'] / d['transfer_s']:.2f}×, loop waited "
                  f"{m['waited_s'] / max(d['waited_s'], 1e-9):.2f}× (both stores verify every bucket's sha256)")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "summary.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
