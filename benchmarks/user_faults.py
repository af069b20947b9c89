"""The user-fault table: each fault a user's own code or flow values cause, on a real run of the quickstart flow at
tiny scale (`rollart run` as a user runs it, the embedded cluster). For each row: the first line the user saw, how
long the command took to stop (or how many failures it counted and went on), non-finite samples trained and
non-finite versions published (from the run's metrics and its last checkpoint), and whether it hung (no end within
--hang-s). The faulty code: tests/user_code/faults_mod.py.

    python benchmarks/user_faults.py                 # ~6 min on 2 cores
    python benchmarks/user_faults.py --only nan      # rows whose name holds 'nan'
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import click
from rich.table import Table

from rollart_dask.observe import console

REPO = Path(__file__).resolve().parent.parent
MOD = str(REPO / "tests" / "user_code" / "faults_mod.py")
BASE = ["trainer.steps=4", "rollout.batch_groups=4", "eval.every=0", "eval.seeds=8", "observe.progress=false", "trainer.max_minutes=null",
        "trainer.checkpoint_every=1", f"imports=[{MOD}]"]
ROWS = {  # name → (what is wrong, --set overrides)
    "reward-nan-some": ("reward: NaN on some trajectories", ["tasks.frozenlake.reward=faults_mod:nan_on_even_turns"]),
    "reward-inf": ("reward: +inf", ["tasks.frozenlake.reward=faults_mod:inf_later"]),
    "reward-string": ("reward: a string", ["tasks.frozenlake.reward=faults_mod:string_later"]),
    "reward-raises": ("reward: raising always", ["tasks.frozenlake.reward=faults_mod:always_raises"]),
    "reward-raises-later": ("reward: raising on the run's trajectories", ["tasks.frozenlake.reward=faults_mod:raises_later"]),
    "reward-raises-10pct": ("reward: raising on 10% of calls", ["tasks.frozenlake.reward=faults_mod:raises_on_a_tenth"]),
    "env-reset-raises": ("env: raising at reset", ["tasks.frozenlake.env=faults_mod:ResetRaises"]),
    "env-step-raises": ("env: raising at step", ["tasks.frozenlake.env=faults_mod:StepRaisesLater"]),
    "env-step-hangs": ("env: hanging in step past its timeout", ["tasks.frozenlake.env=faults_mod:StepHangsLater", "rollout.env_timeout_s=2"]),
    "env-obs-not-text": ("env: a non-string observation", ["tasks.frozenlake.env=faults_mod:DictObservationLater"]),
    "env-unknown": ("an unknown env name", ["tasks.frozenlake.env=nosuchenv"]),
    "eval-start-seed-0": ("eval.start_seed: 0", ["eval.start_seed=0"]),
    "weight-inf": ("a task weight: .inf", ["tasks.frozenlake.weight=.inf"]),
    "group-size-1": ("rollout.group_size: 1", ["rollout.group_size=1"]),
}


def play(name: str, overrides: list[str], out: Path, hang_s: float) -> dict:
    cmd = [sys.executable, "-m", "rollart_dask.entry.cli", "run", str(REPO / "flows" / "quickstart.yaml"), "--out", str(out)]
    for o in [*BASE, *overrides]:
        cmd += ["--set", o]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_s, cwd=REPO)
        hung, output, rc = False, proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        hung, output, rc = True, (e.stdout or b"").decode() + (e.stderr or b"").decode(), None
    seconds = time.monotonic() - t0
    said = _error(output)
    rows = _rows(out / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    nonfinite_trained = sum(not all(math.isfinite(r.get(k, 0.0)) for k in ("reward_mean", "loss", "grad_norm")) for r in steps)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    counts = summary.get("counts", {})
    failures = sum(v for k, v in counts.items() if k.startswith("user_faults_"))
    return {"name": name, "rc": rc, "hung": hung, "seconds": seconds, "said": said, "steps": len(steps), "failures": failures,
            "nonfinite_trained": nonfinite_trained, "nonfinite_published": _nonfinite_checkpoints(out / "checkpoints"),
            "skipped_updates": sum(r.get("nonfinite_skipped", 0) for r in steps)}


def _error(output: str) -> str | None:
    """What the command's error said, its first two lines joined (a flow error names the key on its second)."""
    lines = output.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("Error:")), None)
    return None if at is None else " ".join(line.strip() for line in lines[at: at + 2]).removeprefix("Error: ")


def _rows(path: Path) -> list[dict]:
    from rollart_dask.observe import read_rows

    return read_rows(path) if path.exists() else []


def _nonfinite_checkpoints(root: Path) -> int:
    """Checkpoints of the run whose weights hold a NaN or inf (a version published is checkpointed every step here)."""
    import torch
    from safetensors.torch import load_file

    bad = 0
    for d in sorted(root.glob("step-*")) if root.exists() else []:
        for f in d.glob("*.safetensors"):
            bad += any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in load_file(str(f)).values())
    return bad


@click.command()
@click.option("--only", default="", help="rows whose name holds this")
@click.option("--out", default="runs/bench-user-faults", show_default=True)
@click.option("--hang-s", default=240.0, show_default=True, help="a command not ended by then hung")
def main(only: str, out: str, hang_s: float) -> None:
    results = []
    for name, (what, overrides) in ROWS.items():
        if only in name:
            r = play(name, overrides, Path(out) / name, hang_s)
            r["what"] = what
            console.print(f"{name}: rc={r['rc']} {r['seconds']:.0f}s {r['said'] or ''}", markup=False)
            results.append(r)
    columns = ("fault", "first line the user saw", "stopped after / failures counted", "non-finite samples trained",
               "non-finite versions published", "hung")
    cells = [[r["what"], (r["said"] or "(no error: the run finished)")[:160],
              f"stopped after {r['seconds']:.0f} s" if r["rc"] else
              f"ran to the end ({r['steps']} steps, {r['seconds']:.0f} s): {r['failures']} failures counted",
              str(r["nonfinite_trained"]), str(r["nonfinite_published"]), "yes" if r["hung"] else "no"] for r in results]
    table = Table(*columns, title="user faults (tiny quickstart run; `rollart run` as a user runs it)")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "table.json").write_text(json.dumps(results, indent=2))
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    (Path(out) / "table.md").write_text("\n".join(md) + "\n")
    bad = [r["name"] for r in results if r["hung"] or r["nonfinite_trained"] or r["nonfinite_published"]]
    if bad:
        raise SystemExit(f"hung or non-finite: {bad}")


if __name__ == "__main__":
    main()
