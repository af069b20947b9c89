"""Did two runs replay each other? (rollout.deterministic): step by step what each trained — the batch's digest and the
learning figures — each held-out figure, and the final checkpoint's checksum. Reads two run directories; timings and
throughputs are never compared (they are the one thing a replay does not repeat)."""

from __future__ import annotations

from pathlib import Path

from rollart_dask.control.stopping import weights_digest
from rollart_dask.observe import read_rows

STEP_FIELDS = (  # what a step trained and what the update did with it
    "version", "sha256", "trajectories", "reward_mean", "success", "tasks", "staleness", "samples", "tokens",
    "loss", "pg_loss", "entropy", "approx_kl", "clip_frac", "ratio_mean", "grad_norm",
)  # fmt: skip
EVAL_FIELDS = ("success", "reward_mean", "completed", "seeds")


def compare(a: Path, b: Path) -> dict:
    """``steps`` and ``evals`` compared (over the steps both ran), ``checkpoints`` (each run's checksum), and
    ``differences``: one line each, naming the step or version and the field, empty when b replays a."""
    rows = [read_rows(Path(d) / "metrics.jsonl") for d in (a, b)]
    steps = [[r for r in rs if r.get("kind") == "step"] for rs in rows]
    evals = [[r for r in rs if r.get("kind") == "eval"] for rs in rows]
    diffs = [f"{what}: {len(x)} vs {len(y)}" for what, (x, y) in (("steps", steps), ("held-out evaluations", evals)) if len(x) != len(y)]
    for x, y in zip(*steps):
        diffs += [f"step {x['step']} {k}: {x.get(k)!r} vs {y.get(k)!r}" for k in STEP_FIELDS if x.get(k) != y.get(k)]
    for x, y in zip(*evals):
        for task in sorted(set(x["eval"]) | set(y["eval"])):
            fx, fy = x["eval"].get(task, {}), y["eval"].get(task, {})
            diffs += [f"held-out v{x['version']} {task} {k}: {fx.get(k)!r} vs {fy.get(k)!r}" for k in EVAL_FIELDS if fx.get(k) != fy.get(k)]
    sums = [weights_digest(_latest_checkpoint(Path(d))) for d in (a, b)]
    if sums[0] != sums[1] or sums[0] is None:
        diffs.append(f"final checkpoint sha256: {sums[0]} vs {sums[1]}")
    return {"steps": min(map(len, steps)), "evals": min(map(len, evals)), "checkpoints": sums, "differences": diffs}


def _latest_checkpoint(run_dir: Path) -> str | None:
    pointer = run_dir / "checkpoints" / "latest"  # (control/recovery.py writes it once a checkpoint is whole)
    return pointer.read_text().strip() if pointer.exists() else None
