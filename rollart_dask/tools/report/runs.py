"""A finished (or running) run directory, read for the report: its metrics.jsonl rows by kind, flow.yaml, summary.json."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ReportError(ValueError):
    """A directory the report cannot read: the message names it and what a run directory holds."""


@dataclass
class RunData:
    path: Path
    label: str
    flow: dict
    summary: dict
    steps: list[dict] = field(default_factory=list)  # kind "step", in file order (a --resume appends)
    evals: list[dict] = field(default_factory=list)  # kind "eval" with figures
    others: list[dict] = field(default_factory=list)  # placement, warmstart …

    @property
    def mode(self) -> str:
        r = self.flow.get("rollout", {})
        return f"{r.get('mode', '?')} α={r.get('alpha', '?')}"

    def minutes(self, row: dict) -> float:
        """Minutes since the run's start: wall time from its first row (so a --resume continues the axis), plus
        what that row had already run (its ``elapsed_s``: the first evaluation)."""
        first = (self.evals or self.steps or self.others)[0]
        return (row["time"] - first["time"] + first.get("elapsed_s", 0.0)) / 60


METRICS = ("metrics.jsonl", "metrics.jsonl.gz")  # a run's rows, or the same gzipped (a run archived)


def _metrics(run_dir: Path) -> Path | None:
    return next((run_dir / m for m in METRICS if (run_dir / m).exists()), None)


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Each path is a run directory (it holds metrics.jsonl, or metrics.jsonl.gz) or a folder of them (any depth: a benchmark's OUT)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise ReportError(f"{p}: no such directory (give a run directory, which holds metrics.jsonl, or a folder of them)")
        here = [p] if _metrics(p) else sorted({m.parent for pattern in METRICS for m in p.rglob(pattern)})
        if not here:
            raise ReportError(f"{p}: no metrics.jsonl in it or below it (a run directory is what `rollart run --out` wrote)")
        found += [r for r in here if r not in found]
    return found


def load_run(path: Path, label: str) -> RunData:
    metrics = _metrics(path)
    text = gzip.decompress(metrics.read_bytes()).decode() if metrics.suffix == ".gz" else metrics.read_text()
    rows, lines = [], text.splitlines()
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == len(lines):
                    continue  # a run still writing: its last line may be cut
                raise ReportError(f"{metrics} line {n}: not JSON ({e})") from None
    flow = yaml.safe_load((path / "flow.yaml").read_text()) if (path / "flow.yaml").exists() else {}
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
    run = RunData(path, label, flow or {}, summary)
    for row in rows:
        kind = row.get("kind")
        (run.steps if kind == "step" else run.evals if kind == "eval" and row.get("eval") else run.others).append(row)
    if not run.steps and not run.evals:
        raise ReportError(f"{metrics}: no step or evaluation row yet")
    return run


def load_runs(paths: list[str | Path]) -> list[RunData]:
    """Every run under ``paths``, labelled by its directory's name (its path relative to their common parent if two share a name)."""
    dirs = find_runs(paths)
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):
        root = common_folder(dirs)
        names = [str(d.resolve().relative_to(root)) for d in dirs]
    return [load_run(d, n) for d, n in zip(dirs, names)]


def common_folder(dirs: list[Path]) -> Path:
    """The deepest folder that holds every one of ``dirs``."""
    return Path(os.path.commonpath([d.resolve() for d in dirs]))
