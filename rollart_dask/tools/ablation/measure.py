"""Run an ablation's variants one after the other (each on a fresh embedded cluster), measure
each from its metrics, compute each one's ideal, and write the report."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from rollart_dask.config import FlowConfig, FlowError, load_flow, task_pools
from rollart_dask.observe import console, step_gaps
from rollart_dask.tools.ablation.report import write_report
from rollart_dask.emulation.flow_ideal import reward_slots
from rollart_dask.tools.ablation.spec import METRICS, AblationSpec, fraction


def engine_workers(cfg: FlowConfig) -> dict[str, int]:
    """Engine workers per pool the flow generates on (the TRAIN worker holds no engine)."""
    pools = {p for t in cfg.tasks for p in task_pools(t)}
    return {p: sum(1 for w in cfg.cluster.workers if p in w.pools and "TRAIN" not in w.pools) for p in sorted(pools)}


def summarise(rows: list[dict], scale: float, warmup: int) -> dict:
    """Metrics over the steps after ``warmup`` (emulated seconds = wall / time_scale)."""
    steps = [r for r in rows if r.get("kind") == "step"]
    if len(steps) < warmup + 2:
        raise RuntimeError(f"only {len(steps)} steps recorded; need at least warmup ({warmup}) + 2 to measure step times")
    window = steps[warmup:]
    gaps = step_gaps([r["elapsed_s"] for r in window], scale)
    step_s = sum(gaps) / len(gaps)
    trajs = statistics.mean(r["trajectories"] for r in window[1:])
    rollout = [r["trajectory_s"]["mean"] / scale for r in window[1:] if r.get("trajectory_s", {}).get("n")]
    util = [r["reward"]["utilisation"] for r in window[1:] if r.get("reward", {}).get("utilisation") is not None]
    paid = [r["reward"]["paid_utilisation"] for r in window[1:] if r.get("reward", {}).get("paid_utilisation") is not None]
    busy = {p: statistics.mean(r["pool_busy"].get(p, 0.0) for r in window[1:]) for p in ("H800", "H20", "TRAIN")}
    return {
        "step_s": step_s,
        "throughput": trajs / step_s,
        "rollout_s": statistics.mean(rollout) if rollout else None,
        "reward_utilisation": statistics.mean(util) if util else None,
        "reward_paid_utilisation": statistics.mean(paid) if paid else None,
        "steps_measured": len(gaps),
        "step_s_min": min(gaps),
        "step_s_max": max(gaps),
        "pool_busy": busy,
        "trained_mix": _mix(window[1:]),
        "aborted": sum(v for k, v in steps[-1]["buffer"].items() if "abort" in k or "stale" in k or "redundant" in k),
        "groups_dropped": steps[-1]["buffer"].get("groups_dropped", 0),
        "call_overhead_ms": _overhead(window[1:]),
        "launched_mix": steps[-1].get("mix", {}).get("launched"),
        "mix_shift_pp": steps[-1].get("mix", {}).get("shift_pp"),
        "call_service_ms": _overhead(window[1:], inside_only=True),
    }


def _overhead(steps: list[dict], inside_only: bool = False) -> dict[str, float]:
    """Per call, wall ms the caller waited beyond the time the call spent inside its service (the
    emulated engine's queue + compute, the env's own reset/step): Dask, coalescing, the event loop.
    ``inside_only``: the time inside the service instead (what that wait is a share of)."""
    out = {}
    for stage in ("generate", "env-reset", "env-step"):
        n = sum(r["stage_latency"].get(stage, {}).get("n", 0) for r in steps)
        waited = sum(r["stage_latency"].get(stage, {}).get("sum_s", 0.0) for r in steps)
        inside = sum(r.get("service_s", {}).get(stage, 0.0) for r in steps)
        if n:
            out[stage] = 1000 * (inside if inside_only else waited - inside) / n
    return out


def _mix(steps: list[dict]) -> dict[str, float]:
    """Share of trained groups per task: eager admission can drop slow tasks' groups (a bias to report)."""
    groups: dict[str, int] = {}
    for r in steps:
        for task, t in r.get("tasks", {}).items():
            groups[task] = groups.get(task, 0) + t["groups"]
    total = sum(groups.values()) or 1
    return {k: v / total for k, v in groups.items()}


def ideal_of(cfg: FlowConfig) -> dict:
    from rollart_dask.emulation.flow_ideal import flow_ideal, launched_batches

    ideal = flow_ideal(cfg, engine_workers(cfg), reward_slots(cfg), batches=launched_batches(cfg))  # the measured run's task sequence
    n = ideal.terms["trajectories_per_step"]
    return {
        "step_s": ideal.step_s,
        "throughput": n / ideal.step_s,
        "binding": ideal.binding,
        "step_sd_s": ideal.terms["step_sd_s"],
        "rollout_s": ideal.terms["trajectory_latency_mean_s"],
        "terms": ideal.terms,
    }  # launch → reward, alone


SIM_SEEDS = 4


def simulated_of(cfg: FlowConfig, warmup: int, seeds: int = SIM_SEEDS) -> dict:
    """The variant's policy with a zero-cost runtime (emulation/simulate.py), the mean of ``seeds`` runs of as many
    steps as the measurement: what the runtime would reach if its calls cost nothing."""
    from rollart_dask.emulation.simulate import simulate

    runs = [simulate(cfg, engine_workers(cfg), reward_slots(cfg), warmup=warmup, seed=s) for s in range(seeds)]
    mix: dict[str, float] = {}
    held: dict[str, float] = {}  # which tasks hold the admitted (open) groups, time-averaged
    for r in runs:
        for k, v in r.trained_mix.items():
            mix[k] = mix.get(k, 0.0) + v / len(runs)
        for k, v in r.held_mix.items():
            held[k] = held.get(k, 0.0) + v / len(runs)
    rollout = [r.rollout_s for r in runs if r.rollout_s is not None]
    return {
        "step_s": statistics.mean(r.step_s for r in runs),
        "step_sd_s": statistics.pstdev(r.step_s for r in runs),
        "throughput": statistics.mean(r.throughput for r in runs),
        "rollout_s": statistics.mean(rollout) if rollout else None,
        "trained_mix": mix,
        "held_mix": held,
        "aborted": statistics.mean(sum(v for k, v in r.counts.items() if "stale" in k or "redundant" in k) for r in runs),
        "groups_dropped": statistics.mean(r.counts.get("groups_dropped", 0) for r in runs),
        "seeds": seeds,
        "mix_shift_pp": statistics.mean(r.mix_shift_pp for r in runs),
        "length_shift_pp": statistics.mean(r.length_shift_pp for r in runs),
    }


def cost_of(cfg: FlowConfig, measured: dict, ideal: dict) -> dict:
    """Normalised cost (H20 GPU-hours) per step and per trajectory, at the measured step and at the ideal one."""
    from rollart_dask.emulation.cost import step_cost
    from rollart_dask.emulation.flow_ideal import task_loads

    reward_s = sum(t.share * t.reward_s for t in task_loads(cfg))  # per trajectory, at the launched mix
    return {
        k: step_cost(cfg, engine_workers(cfg), x["step_s"], x["throughput"] * x["step_s"], reward_s)
        for k, x in (("measured", measured), ("ideal", ideal))
    }


def variant_flow(spec: AblationSpec, path: Path, name: str, quick: bool, tiny: bool, extra: list[str]) -> FlowConfig:
    import yaml

    v = spec.variant(name)
    overrides = [*spec.set, *(spec.quick if quick or tiny else []), *(spec.tiny if tiny else []), *v.set, *extra]
    flow = path.parent / spec.flow
    if not flow.is_file():
        raise FlowError(f"{path}: flow {spec.flow} not found (relative to the ablation file)")
    data = yaml.safe_load(flow.read_text())
    if spec.tasks is not None:
        unknown = sorted(set(spec.tasks) - {t["name"] for t in data["tasks"]})
        if unknown:
            raise FlowError(f"{path}: tasks {unknown} are not in {spec.flow}")
        data["tasks"] = [t for t in data["tasks"] if t["name"] in spec.tasks]
    cfg = load_flow(data=data, overrides=overrides)
    if not cfg.emulated:
        raise FlowError(
            f"{path}: variant {name!r} is not emulated (engine.backend={cfg.engine.backend}); ablations run on emulated hardware"
        )
    return cfg


async def _run_variant(cfg: FlowConfig, out: Path) -> dict:
    from rollart_dask.entry.api import run_flow

    return await run_flow(cfg, out)


def _run_blocking(cfg: FlowConfig, out: Path) -> dict:
    """A variant to its end. Where this thread already runs an event loop (a Jupyter kernel runs its
    cells in one), asyncio.run cannot nest: the variant gets a thread and an event loop of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_run_variant(cfg, out))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="rollart-ablation") as pool:
        return pool.submit(lambda: asyncio.run(_run_variant(cfg, out))).result()


def run_ablation(
    spec: AblationSpec,
    path: Path,
    out: Path,
    quick: bool = False,
    tiny: bool = False,
    extra: list[str] | None = None,
    report_only: bool = False,
) -> list[dict]:
    """Every variant, measured and beside its ideal; writes results.csv/.md/.png under ``out``. ``report_only``: the
    variants' runs already under ``out`` are reported again — ideal, simulation and cost recomputed — and none is run."""
    out.mkdir(parents=True, exist_ok=True)
    before = (
        {r["variant"]: r for r in json.loads((out / "results.json").read_text())} if report_only and (out / "results.json").exists() else {}
    )
    results = []
    for v in spec.variants:
        cfg = variant_flow(spec, path, v.name, quick, tiny, list(extra or []))
        run_dir = out / "runs" / _slug(v.name)
        t0 = time.monotonic()
        if report_only:
            if not (run_dir / "metrics.jsonl").exists():
                raise FlowError(
                    f"--report-only: no run of variant {v.name!r} under {run_dir} (run the ablation first, with the same --out)"
                )
        else:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh measurement, never appended to an old one
            console.print(
                f"[bold]{spec.figure} — {v.name}[/bold] ({' '.join(v.set) or 'base'}): {cfg.trainer.steps} steps, "
                f"time_scale {cfg.emulation.time_scale} [yellow](EMULATED hardware)[/yellow]"
            )
            _run_blocking(cfg, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        measured = summarise(rows, cfg.emulation.time_scale, spec.warmup_steps)
        ideal = ideal_of(cfg)
        simulated = simulated_of(cfg, spec.warmup_steps)
        results.append(
            {
                "variant": v.name,
                "set": v.set,
                "measured": measured,
                "ideal": ideal,
                "simulated": simulated,
                "cost": cost_of(cfg, measured, ideal),
                "wall_s": before.get(v.name, {}).get("wall_s") if report_only else time.monotonic() - t0,
                "time_scale": cfg.emulation.time_scale,
                "mode": cfg.rollout.mode,
                "alpha": cfg.rollout.alpha,
                "level": cfg.rollout.level,
            }
        )
        label, unit, _ = METRICS[spec.metric]
        m, i = measured[spec.metric], ideal.get(spec.metric)
        console.print(f"  {label}: {m:.3g} {unit}" + (f" (ideal {i:.3g}, fraction {fraction(spec.metric, m, i):.2f})" if i else ""))
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    write_report(spec, results, out)
    return results


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name.replace("α", "alpha").replace("σ", "sigma"))
