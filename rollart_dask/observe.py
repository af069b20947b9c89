"""Metrics out: JSONL (one line per step) and the experiment trackers (trackers.py), a progress bar, a summary table."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollart_dask.config import ObserveConfig
from rollart_dask.models.prompts import as_chat
from rollart_dask.trackers import TRACKERS

console = Console(stderr=True)


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a last line cut short (a run killed mid-write, or still writing) is left out."""
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise ValueError(f"{path} line {n}: not JSON") from None
    return rows


def drop_cut_line(path: Path) -> None:
    """Cut a file of lines back to its last whole line (its writer died mid-line)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])
        console.print(f"{path}: its last line was cut short (the run stopped mid-write): left out", markup=False, style="yellow")


class MetricsWriter:
    """metrics.jsonl, always; every row also goes to the trackers ``observe.loggers`` names (trackers.py)."""

    def __init__(self, out_dir: Path, observe: ObserveConfig | None = None, flow: dict | None = None):
        observe = observe if observe is not None else ObserveConfig()
        self.path, self._f, self._samples = out_dir / "metrics.jsonl", None, None
        self.trackers: dict = {}
        try:
            for name in observe.loggers:
                self.trackers[name] = TRACKERS[name](out_dir, observe, flow or {})
        except BaseException:  # (an extra not installed, a server refusing): the runs already started end, not dangle
            self.close()
            raise
        drop_cut_line(self.path)  # (a resumed run appends: a cut last row would be followed by a whole one)
        self._f = self.path.open("a")
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        row = {"time": time.time(), **row}
        self.rows.append(row)
        self._f.write(json.dumps(row, default=float) + "\n")
        self._f.flush()
        for name, tracker in list(self.trackers.items()):
            self._call(name, tracker.log, row)

    def samples(self, version: int, trajectories: list) -> None:
        """Trained trajectories as the model saw them (OUT/samples.jsonl): each turn's messages, prompt and response ids."""
        if not trajectories:
            return
        if self._samples is None:
            self._samples = self.path.with_name("samples.jsonl").open("a")
        for t in trajectories:
            self._samples.write(
                json.dumps(
                    {
                        "trained_on_version": version,
                        "id": t.id,
                        "task": t.task,
                        "seed": t.seed,
                        "version": t.version,
                        "reward": t.reward,
                        "success": t.success,
                        "turns": [
                            {
                                "messages": as_chat(u.messages),
                                "prompt_ids": u.prompt_ids,
                                "response_ids": u.response_ids,
                                "action": u.action,
                                "env_reward": u.env_reward,
                                "version": u.version,
                            }
                            for u in t.turns
                        ],
                    },
                    default=str,
                )
                + "\n"
            )
        self._samples.flush()

    def close(self, final_checkpoint: str | Path | None = None) -> None:
        """``final_checkpoint``: the run's last checkpoint directory, an artefact of the trackers that keep files."""
        if self._samples is not None:
            self._samples.close()
        if self._f is not None:
            self._f.close()
        ckpt = Path(final_checkpoint) if final_checkpoint is not None and Path(final_checkpoint).is_dir() else None
        for name, tracker in list(self.trackers.items()):
            self._call(name, tracker.close, ckpt)
        self.trackers.clear()

    def _call(self, name: str, fn, arg) -> None:
        """A tracker that fails (its server gone, its disk full) is left out from then on: the run and metrics.jsonl go on."""
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001 (any failure of a third-party tracker)
            console.print(
                f"[yellow]observe.loggers: {name} failed ({type(e).__name__}: {e}); "
                f"left out from here (metrics.jsonl has every row)[/yellow]"
            )
            self.trackers.pop(name, None)


def step_gaps(times: list[float], scale: float = 1.0) -> list[float]:
    """Seconds between consecutive step ends (``times``, in order), ÷ ``scale`` (an emulated flow's time_scale: emulated s)."""
    return [(b - a) / scale for a, b in zip(times, times[1:])]


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for k, v in rows:
        table.add_row(k, v)
    return table
