"""`rollart ablate calibrate`: the paper's qualitative facts about its workload (Fig. 3–6), checked on the
EMULATED workload file before any figure is measured (flows/ablations/workloads/calibration.yaml says which
facts, their targets and how each is computed). Pure computation — the hardware roofline, the injected latency
and failure specs, the ideal step — no cluster, so a workload edit is checked in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from rollart_dask.config import FlowConfig, FlowError, load_flow
from rollart_dask.tools.ablation.measure import engine_workers, reward_slots
from rollart_dask.tools.ablation.spec import ABLATIONS_DIR, load_ablation
from rollart_dask.emulation.flow_ideal import env_times, flow_ideal, task_loads
from rollart_dask.emulation.hardware import GPUS, MODELS
from rollart_dask.emulation.ideal import Pool, generation_latency, per_trajectory_seconds

FACTS = ABLATIONS_DIR / "workloads" / "calibration.yaml"


@dataclass
class Fact:
    figure: str
    claim: str  # the paper's fact, and how it is read here
    measured: str  # what the workload gives
    holds: bool
    values: dict


def _flow(facts_path: Path, facts: dict, overrides: list[str]) -> FlowConfig:
    path = facts_path.parent / facts["workload"]
    if not path.is_file():
        raise FlowError(f"{facts_path}: workload {facts['workload']} not found (relative to the facts file)")
    return load_flow(data=yaml.safe_load(path.read_text()), overrides=overrides)


def _scenario(facts_path: Path, name: str, keep) -> list[str]:
    """The overrides of an ablation's ``set`` that ``keep`` selects (the failures it injects, the rewards' cost)."""
    spec, _ = load_ablation(str(facts_path.parent / name))
    return [s for s in spec.set if keep(s.split("=", 1)[0])]


def affinity(cfg: FlowConfig, expected: dict[str, str]) -> list[Fact]:
    """Fig. 4: which GPU type generates each task faster, at the workload's load and alone."""
    model, loads = MODELS[cfg.emulation.model], {t.name: t for t in task_loads(cfg)}
    out = []
    for task, gpu in expected.items():
        if task not in loads:
            raise FlowError(f"calibration: task {task!r} is not in the workload (tasks: {sorted(loads)})")
        if gpu not in GPUS:
            raise FlowError(f"calibration: {task}: GPU {gpu!r} unknown (known: {sorted(GPUS)})")
        w = loads[task].workload
        gpus = max(p.gpus for p in cfg.emulation.pools.values())  # the same count of each type: per-GPU speed
        load = {g: per_trajectory_seconds(w, model, Pool(GPUS[g], gpus)) for g in GPUS}
        alone = {g: generation_latency(w, model, Pool(GPUS[g], gpus)) for g in GPUS}
        other = next(g for g in GPUS if g != gpu)
        holds = load[gpu] < load[other] and alone[gpu] < alone[other]
        out.append(
            Fact(
                "Fig. 4",
                f"{task} generates faster on {gpu} than on {other}",
                f"{other}/{gpu} time: {load[other] / load[gpu]:.2f}× at load, {alone[other] / alone[gpu]:.2f}× alone",
                holds,
                {"at_load_s": load, "alone_s": alone},
            )
        )
    return out


def env_tails(cfg: FlowConfig, facts: dict, n: int = 20000) -> Fact:
    """Fig. 5: heavy-tailed reset and step latencies, the reset tail in the hundreds of seconds."""
    rng = np.random.default_rng(0)
    per_task, ratios = {}, []
    for t in cfg.tasks:
        if not t.inject:
            continue
        latency_only = {k: v for k, v in t.inject.items() if k.endswith("_latency") or k == "seed"}
        reset, steps, _ = env_times(latency_only, rng, n, 1)
        q = {call: (float(np.quantile(x, 0.5)), float(np.quantile(x, 0.99))) for call, x in (("reset", reset), ("step", steps[:, 0]))}
        per_task[t.name] = q
        ratios += [p99 / p50 for p50, p99 in q.values() if p50 > 0]
    if not per_task:
        return Fact("Fig. 5", "env latency is heavy-tailed", "no task injects env latency", False, {})
    tail = min(ratios) if ratios else 0.0
    reset_p99 = max(q["reset"][1] for q in per_task.values())
    holds = tail >= facts["tail_over_median_min"] and reset_p99 >= facts["reset_p99_s_min"]
    shown = "; ".join(
        f"{k} reset {q['reset'][0]:.0f}/{q['reset'][1]:.0f} s, step {q['step'][0]:.1f}/{q['step'][1]:.0f} s" for k, q in per_task.items()
    )
    return Fact(
        "Fig. 5",
        f"p99 ≥ {facts['tail_over_median_min']}× p50 for every injected call; slowest reset p99 ≥ {facts['reset_p99_s_min']} s",
        f"p50/p99: {shown}; smallest p99/p50 {tail:.1f}, reset p99 {reset_p99:.0f} s",
        holds,
        {"per_task": per_task, "smallest_tail_ratio": tail, "reset_p99_s": reset_p99},
    )


def _within(value: float, target: dict) -> bool:
    return abs(value - target["paper"]) <= target["tolerance"]


def failures(facts_path: Path, facts: dict, workload: dict) -> list[Fact]:
    """Fig. 3: what env failures do to a synchronous step, and how much of its rollout env.reset then takes."""
    injected = _scenario(facts_path, facts["scenario"], lambda key: key.startswith("tasks.") and ".inject." in key)
    if not injected:
        raise FlowError(f"calibration: {facts['scenario']} injects no env failures (no tasks.*.inject.* in its set)")
    ok, bad = (_ideal(_flow(facts_path, workload, ["rollout.mode=sync", *extra])) for extra in ([], injected))
    ratio = bad.step_s / ok.step_s
    share = bad.terms["reset_wave_s"] / bad.terms["makespan_s"]
    t = facts["step_ratio"], facts["reset_share"]
    return [
        Fact(
            "Fig. 3",
            f"step with failures / without = {t[0]['paper']} ± {t[0]['tolerance']} (513.3 s / 365.7 s)",
            f"{bad.step_s:.0f} s / {ok.step_s:.0f} s = {ratio:.2f}",
            _within(ratio, t[0]),
            {"step_s": ok.step_s, "step_with_failures_s": bad.step_s, "ratio": ratio},
        ),
        Fact(
            "Fig. 3",
            f"env.reset share of rollout with failures = {t[1]['paper']} ± {t[1]['tolerance']}",
            f"reset phase {bad.terms['reset_wave_s']:.0f} s of {bad.terms['makespan_s']:.0f} s = {share:.2f} "
            f"(without failures {ok.terms['reset_wave_s'] / ok.terms['makespan_s']:.2f})",
            _within(share, t[1]),
            {"reset_share": share, "reset_share_without_failures": ok.terms["reset_wave_s"] / ok.terms["makespan_s"]},
        ),
    ]


def reward_gpu(facts_path: Path, facts: dict, workload: dict) -> Fact:
    """Fig. 6: how busy a dedicated reward GPU is over a synchronous step."""
    cost = _scenario(facts_path, facts["scenario"], lambda key: key.endswith(".reward_s"))
    cfg = _flow(facts_path, workload, ["rollout.mode=sync", "reward.mode=local", *cost])
    ideal = _ideal(cfg)
    reward_s = sum(t.n * t.reward_s for t in task_loads(cfg))
    hosts = max(1, sum(1 for w in cfg.cluster.workers if "REWARD" in w.pools))
    busy = reward_s / (ideal.step_s * hosts)
    return Fact(
        "Fig. 6",
        f"dedicated reward GPU busy {facts['busy']['paper']:.1%} ± {facts['busy']['tolerance']:.1%} of a step",
        f"{reward_s:.0f} reward-s per {ideal.step_s:.0f} s step on {hosts} GPU: {busy:.1%}",
        _within(busy, facts["busy"]),
        {"reward_s_per_step": reward_s, "step_s": ideal.step_s, "busy": busy},
    )


def _ideal(cfg: FlowConfig):
    return flow_ideal(cfg, engine_workers(cfg), reward_slots(cfg))


def calibrate(facts_path: str | Path = FACTS) -> list[Fact]:
    """Every fact of the facts file, checked on its workload."""
    facts_path = Path(facts_path)
    if not facts_path.is_file():
        raise FlowError(f"calibration facts {facts_path} not found")
    facts = yaml.safe_load(facts_path.read_text())
    cfg = _flow(facts_path, facts, [])
    return [
        *affinity(cfg, facts["fig4_affinity"]),
        env_tails(cfg, facts["fig5_env_tails"]),
        *failures(facts_path, facts["fig3_failures"], facts),
        reward_gpu(facts_path, facts["fig6_reward_gpu"], facts),
    ]


def print_facts(facts: list[Fact]) -> None:
    from rich.table import Table

    from rollart_dask.observe import console

    table = Table(title="workload calibration: the paper's facts (Fig. 3–6) on the EMULATED workload")
    for col in ("figure", "fact", "on the workload", "holds"):
        table.add_column(col, overflow="fold")
    for f in facts:
        table.add_row(f.figure, f.claim, f.measured, "[green]yes[/green]" if f.holds else "[red]NO[/red]")
    console.print(table)
