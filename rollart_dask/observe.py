"""Metrics out: JSONL (one line per step), TensorBoard scalars, a progress bar, a summary table."""
from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


class MetricsWriter:
    def __init__(self, out_dir: Path, tensorboard: bool = True):
        self.path = out_dir / "metrics.jsonl"
        self._f = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        row = {"time": time.time(), **row}
        self.rows.append(row)
        self._f.write(json.dumps(row, default=float) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = int(row.get("step", len(self.rows)))
            for k, v in _flatten(row).items():
                if isinstance(v, (int, float)) and k not in ("time", "step"):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def step_gaps(times: list[float], scale: float = 1.0) -> list[float]:
    """Seconds between consecutive step ends (``times``, in order), ÷ ``scale`` (an emulated flow's time_scale: emulated s)."""
    return [(b - a) / scale for a, b in zip(times, times[1:])]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    return table
