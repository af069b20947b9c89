"""Reward capacity: local dedicated worker (the paper's baseline) vs serverless (AWS Lambda API),
side by side on the same workload, beside the paper's Fig. 14 numbers.

Both runs use the same flow, seeds and step count, one after the other in this process, each on
a fresh embedded cluster; `serverless` calls the rewards through boto3 → a local Lambda-compatible
endpoint started for the run (or `--set reward.endpoint_url=…`). Per run it reports the wall time
per training step (our rollout time per step: trajectories are decoupled from steps), the reward
call latency, and the utilisation of reward capacity (docs/concepts/rewards.md):
  local      = busy time / reserved time of the dedicated REWARD worker
  serverless = billed duration / lifetime of the execution environments the endpoint kept

    python benchmarks/reward_local_vs_serverless.py                 # multitask flow, 40 steps each
    python benchmarks/reward_local_vs_serverless.py --steps 5 --set eval.seeds=4    # a quick look
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

from rollart_dask.entry.api import run_sync
from rollart_dask.config import load_flow
from rollart_dask.observe import console

PAPER = {"local": {"utilisation": 0.06, "rollout_s": 158.0}, "serverless": {"utilisation": 0.88, "rollout_s": 77.0}}  # RollArt Fig. 14


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def summarise(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["kind"] == "step"][1:]  # the first step includes start-up
    if not steps:
        return {}
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])] or [steps[0]["elapsed_s"]]
    util = [r["reward"]["utilisation"] for r in steps if r.get("reward", {}).get("utilisation") is not None]
    lat = [r["stage_latency"]["reward"] for r in steps if "reward" in r.get("stage_latency", {})]
    rew = [r["reward"] for r in steps]
    total = lambda key: sum(x.get(key, 0) or 0 for x in rew)  # noqa: E731
    return {
        "steps": len(steps),
        "s_per_step": statistics.median(gaps),
        "utilisation": statistics.mean(util) if util else None,
        "reward_call_p50_ms": statistics.median(x["p50_ms"] for x in lat) if lat else None,
        "reward_call_p99_ms": max(x["p99_ms"] for x in lat) if lat else None,
        "calls": total("calls"),
        "cold_starts": total("cold_starts"),
        "throttles": total("throttles"),
    }


@click.command()
@click.option("--flow", default="flows/multitask.yaml", show_default=True)
@click.option("--steps", default=40, show_default=True, help="training steps per mode")
@click.option("--out", default="runs/bench-reward", show_default=True)
@click.option("--set", "overrides", multiple=True)
def main(flow, steps, out, overrides):
    results = {}
    for mode in ("local", "serverless"):
        cfg = load_flow(
            flow,
            [
                f"reward.mode={mode}",
                f"trainer.steps={steps}",
                "trainer.max_minutes=60",
                "eval.every=0",
                "warmstart.steps=0",
                "observe.progress=false",
                *overrides,
            ],
        )
        out_dir = Path(out) / mode
        console.print(f"[bold]reward.mode={mode}[/bold]: {steps} steps of {flow}")
        run_sync(cfg, out_dir)
        results[mode] = summarise([json.loads(line) for line in (out_dir / "metrics.jsonl").open()])
    from rich.table import Table

    table = Table(title=f"reward capacity, local vs serverless ({flow}, {steps} steps each) beside RollArt Fig. 14")
    for col in (
        "reward.mode",
        "utilisation (ours)",
        "paper",
        "s/step (ours)",
        "paper rollout s/step",
        "reward call p50 / p99",
        "calls",
        "cold starts",
        "throttles",
    ):
        table.add_column(col)
    for mode, r in results.items():
        table.add_row(
            mode,
            fmt(r.get("utilisation"), "{:.1%}"),
            f"{PAPER[mode]['utilisation']:.0%}",
            fmt(r.get("s_per_step"), "{:.2f}"),
            f"{PAPER[mode]['rollout_s']:.0f}",
            f"{fmt(r.get('reward_call_p50_ms'), '{:.0f}')} / {fmt(r.get('reward_call_p99_ms'), '{:.0f}')} ms",
            str(r.get("calls")),
            str(r.get("cold_starts")),
            str(r.get("throttles")),
        )
    console.print(table)
    loc, srv = results["local"], results["serverless"]
    if loc.get("s_per_step") and srv.get("s_per_step"):
        console.print(
            f"serverless / local: step time ×{srv['s_per_step'] / loc['s_per_step']:.2f} (paper ×{77 / 158:.2f}), utilisation "
            f"{fmt(loc.get('utilisation'), '{:.1%}')} → {fmt(srv.get('utilisation'), '{:.1%}')} (paper 6% → 88%)"
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
