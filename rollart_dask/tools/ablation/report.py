"""An ablation's report: results.csv, results.md (paper beside ours beside the ideal) and results.png."""

from __future__ import annotations

import csv
from pathlib import Path

from rollart_dask.tools.ablation.spec import METRICS, AblationSpec, fraction


def _is_value(metric: str) -> bool:
    """Utilisations are reported as values, not as speed-ups against a baseline."""
    return metric.startswith("reward_")


def _mix(shares: dict | None) -> str:
    return " ".join(f"{k}:{v:.2f}" for k, v in sorted((shares or {}).items()))


def _ratio(metric: str, value: float | None, base: float | None) -> float | None:
    """Speed-up against the baseline (>1 = better), or the value itself for utilisation."""
    if _is_value(metric):
        return value
    if not value or not base:
        return None
    return value / base if METRICS[metric][2] else base / value


def rows_of(spec: AblationSpec, results: list[dict]) -> list[dict]:
    by_name = {r["variant"]: r for r in results}
    rows = []
    for r in results:
        base = by_name[spec.baseline_of(r["variant"])]
        m = r["measured"]
        row = {"figure": spec.figure, "variant": r["variant"], "settings": " ".join(r["set"]), "metric": spec.metric}
        for metric in [spec.metric, *spec.also]:
            val, ideal = m.get(metric), r["ideal"].get(metric)
            sfx = "" if metric == spec.metric else f" {metric}"
            row[f"ours{sfx}"] = val
            row[f"ideal{sfx}"] = ideal
            row[f"fraction_of_ideal{sfx}"] = fraction(metric, val, ideal)
            sim = (r.get("simulated") or {}).get(metric)
            row[f"simulated{sfx}"] = sim
            row[f"fraction_of_simulated{sfx}"] = fraction(metric, val, sim)  # what the runtime keeps of its policy's reach
            row[f"simulated_fraction_of_ideal{sfx}"] = fraction(metric, sim, ideal)  # what the policy reaches of the bound
        row["ours_vs_baseline"] = _ratio(spec.metric, m.get(spec.metric), base["measured"].get(spec.metric))
        row["ideal_vs_baseline"] = _ratio(spec.metric, r["ideal"].get(spec.metric), base["ideal"].get(spec.metric))
        row["baseline"] = base["variant"]
        row["paper_vs_baseline"] = spec.paper.get(r["variant"])
        row["aborted"] = m.get("aborted")
        row["groups_dropped"] = m.get("groups_dropped")
        simulated = r.get("simulated") or {}
        row["trained_mix"] = _mix(m.get("trained_mix"))
        row["launched_mix"] = _mix(m.get("launched_mix"))
        row["mix_shift_pp"] = m.get("mix_shift_pp")
        row["simulated_mix_shift_pp"] = simulated.get("mix_shift_pp")
        row["simulated_length_shift_pp"] = simulated.get("length_shift_pp")
        row["simulated_held_mix"] = _mix(simulated.get("held_mix"))
        row["eager_trainable_mix"] = _mix(r["ideal"].get("terms", {}).get("eager_trainable_mix"))
        row["simulated_mix"] = _mix(simulated.get("trained_mix"))
        cost = r.get("cost") or {}
        row["cost_per_step"] = cost.get("measured", {}).get("per_step")
        row["cost_per_trajectory"] = cost.get("measured", {}).get("per_trajectory")
        row["ideal_cost_per_trajectory"] = cost.get("ideal", {}).get("per_trajectory")
        row["binding"] = r["ideal"].get("binding")
        # two standard errors of an n-step mean of the ideal step time: how far a short measurement may land from it by luck
        row["ideal_step_noise_s"] = 2 * r["ideal"].get("step_sd_s", 0.0) / max(1, m["steps_measured"]) ** 0.5
        row["steps_measured"] = m["steps_measured"]
        row["time_scale"] = r["time_scale"]
        rows.append(row)
    return rows


def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def write_report(spec: AblationSpec, results: list[dict], out: Path) -> None:
    rows = rows_of(spec, results)
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    label, unit, _ = METRICS[spec.metric]
    ratio = "value" if _is_value(spec.metric) else "speed-up vs baseline"
    lines = [
        f"### {spec.figure}: {spec.title} (EMULATED hardware)",
        "",
        f"Metric: {label} ({unit}), measured over {rows[0]['steps_measured']} steps after {spec.warmup_steps} warm-up steps, "
        f"time scale {rows[0]['time_scale']}.",
        "",
        f"| variant | ours | simulated | ideal | ours / ideal | ours / simulated (runtime) | simulated / ideal (policy) "
        f"| ours, {ratio} | ideal, {ratio} | paper, {ratio} | baseline | ideal bound "
        f"| aborted / groups dropped | trained task mix (simulated) | launched mix | mix shift, pp (simulated) "
        f"| cost per step / per trajectory (ideal) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {_fmt(r['ours'])} | {_fmt(r['simulated'])} | {_fmt(r['ideal'])} | {_fmt(r['fraction_of_ideal'])} "
            f"| {_fmt(r['fraction_of_simulated'])} | {_fmt(r['simulated_fraction_of_ideal'])} | {_fmt(r['ours_vs_baseline'])} "
            f"| {_fmt(r['ideal_vs_baseline'])} | {_fmt(r['paper_vs_baseline'])} | {r['baseline']} | {r['binding']} "
            f"| {_fmt(r['aborted'])} / {_fmt(r['groups_dropped'])} | {r['trained_mix']} ({r['simulated_mix']}) "
            f"| {r['launched_mix'] or '—'} | {_fmt(r['mix_shift_pp'])} ({_fmt(r['simulated_mix_shift_pp'])}) "
            f"| {_fmt(r['cost_per_step'])} / {_fmt(r['cost_per_trajectory'])} ({_fmt(r['ideal_cost_per_trajectory'])}) |"
        )
    lines += [
        "",
        "Mix shift: the largest gap, in percentage points, between a task's share of the groups launched and of "
        "those trained, since the start (warm-up included), as the last batch was taken (rollout.fairness=task keeps it "
        "within about one group). Length shift (simulated: only the simulation knows the length of an aborted "
        "trajectory): within each task, the largest gap between the trained trajectories' share in a quartile of the "
        "launched trajectories' lengths and 25%: "
        + ", ".join(f"{r['variant']} {_fmt(r['simulated_length_shift_pp'])} pp" for r in rows)
        + ".",
    ]
    lines += [
        "",
        "Simulated: the same policy (admission, staleness bound, redundancy, protocol; the real SampleBuffer) in a "
        "discrete-event simulation of the same workload with calls that cost nothing (rollart_dask/emulation/"
        "simulate.py), mean of its seeds. Ours / simulated is what the runtime keeps of what its policy can reach; "
        "simulated / ideal is what the policy reaches of the bound.",
    ]
    lines += [
        "",
        "Cost: normalised GPU-hours (H20 = 1.00, H800 = 2.85 per GPU-hour, the paper's table) of everything the variant "
        "holds for a step — generation pools, trainer, a dedicated reward GPU when rewards are local, env hosts — plus "
        "serverless rewards' billed seconds; CPU and serverless priced through public price lists "
        "(rollart_dask/emulation/cost.py, each price with its source).",
    ]
    lines += [
        "",
        "Ideal step time ± two standard errors of a mean over the measured steps (heavy env tails make short "
        "measurements land on either side of the ideal by luck): "
        + ", ".join(
            f"{r['variant']} {_fmt(next(x['ideal']['step_s'] for x in results if x['variant'] == r['variant']))} ± "
            f"{_fmt(r['ideal_step_noise_s'])} s"
            for r in rows
        ),
    ]
    lines += [
        "",
        "Which tasks each variant trains and which hold its admission (groups open, time-averaged, simulated); for "
        "eager admission, the mix its bound can train (groups that fit their staleness window at the ideal step):",
    ]
    lines += [
        f"- {r['variant']}: trained {r['trained_mix'] or '—'} (simulated {r['simulated_mix'] or '—'}); admission held by "
        f"{r['simulated_held_mix'] or '—'}" + (f"; trainable at the bound {r['eager_trainable_mix']}" if r["eager_trainable_mix"] else "")
        for r in rows
    ]
    for metric in spec.also:
        lines += [
            "",
            f"Also: {METRICS[metric][0]} ({METRICS[metric][1]}): "
            + ", ".join(f"{r['variant']} {_fmt(r[f'ours {metric}'])} (ideal {_fmt(r[f'ideal {metric}'])})" for r in rows),
        ]
    lines += [
        "",
        "Where the time beyond the ideal goes (measured): per call, wall ms the caller waited beyond the call's own "
        "time inside its service, and that per turn in emulated seconds (÷ time scale); stale aborts and dropped groups "
        "are in the table.",
    ]
    for r in results:
        o = r["measured"].get("call_overhead_ms") or {}
        turn = (o.get("generate", 0.0) + o.get("env-step", 0.0)) / 1000 / r["time_scale"] if r["time_scale"] else 0.0
        lines.append(f"- {r['variant']}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in o.items()) + f" → ~{turn:.1f} emulated s per turn")
    if spec.paper_note:
        lines += ["", f"Paper: {spec.paper_note}"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(spec, rows, out / "results.png")


def _plot(spec: AblationSpec, rows: list[dict], path: Path) -> None:
    # The Figure itself, not pyplot: no backend is chosen or switched (in a notebook kernel pyplot's
    # inline backend stays as it was), and the PNG is drawn by Agg either way.
    from rollart_dask.extras import require

    require("matplotlib", "report", "the ablation's figure (results.png)")
    from matplotlib.figure import Figure

    label, unit, _ = METRICS[spec.metric]
    names = [r["variant"] for r in rows]
    fig = Figure(figsize=(16, 4))
    a, b, c = fig.subplots(1, 3)
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["ours"] or 0 for r in rows], 0.4, label="ours (emulated)")
    a.bar([i + 0.2 for i in x], [r["ideal"] or 0 for r in rows], 0.4, label="ideal", color="lightgray", edgecolor="gray")
    a.set_xticks(list(x), names, rotation=20)
    a.set_ylabel(f"{label} ({unit})")
    a.legend()
    a.set_title(f"{spec.figure}: {label}")
    ratio = "value" if _is_value(spec.metric) else "speed-up vs baseline"
    b.bar([i - 0.27 for i in x], [r["ours_vs_baseline"] or 0 for r in rows], 0.27, label="ours")
    b.bar(list(x), [r["ideal_vs_baseline"] or 0 for r in rows], 0.27, label="ideal", color="lightgray", edgecolor="gray")
    b.bar([i + 0.27 for i in x], [r["paper_vs_baseline"] or 0 for r in rows], 0.27, label="paper", color="tab:orange")
    b.set_xticks(list(x), names, rotation=20)
    b.set_ylabel(ratio)
    b.legend()
    b.set_title("ours vs ideal vs paper")
    # what each variant's speed is bought with: how far what it trained is from what it launched
    c.bar([i - 0.2 for i in x], [r["mix_shift_pp"] or 0 for r in rows], 0.4, label="task mix shift (ours)", color="tab:red")
    c.bar(
        [i + 0.2 for i in x], [r["simulated_length_shift_pp"] or 0 for r in rows], 0.4, label="length shift (simulated)", color="tab:purple"
    )
    c.set_xticks(list(x), names, rotation=20)
    c.set_ylabel("trained vs launched (percentage points)")
    c.legend()
    c.set_title("trained vs launched: the largest gap")
    fig.suptitle(f"{spec.title} — EMULATED hardware, real runtime", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
