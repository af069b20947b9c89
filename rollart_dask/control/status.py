"""What the run's helpers (trainer recovery, elasticity, telemetry, the launcher) share with the run, and nothing
more: the published version, the counters, the run's clock and last progress, and how the run fails. They are given
this record, not the run: what they can change of it is what is here (control/run.py keeps the rest to itself)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Callable


class RunStatus:
    def __init__(self):
        self.published = 0  # the policy version: published optimizer updates (set by the run as each Train ends)
        self.counts: Counter = Counter()  # what happened, by name: the summary's counts
        self.fatal: Exception | None = None  # the first error that ends the run
        self.failing = asyncio.Event()  # set with ``fatal``: a wait that cannot end without the run waits on this too
        self._on_fail: list[Callable[[], None]] = []
        self.t_start = self.progress_at = time.monotonic()  # the run's clock; the last progress (a step ended, an alert)

    def started(self) -> None:
        """The run's clock starts now: set-up (model loads, warm start) is neither elapsed time nor a stall."""
        self.t_start = self.progress_at = time.monotonic()

    def progressed(self) -> None:
        self.progress_at = time.monotonic()

    def fail(self, error: Exception) -> None:
        """End the run (a trainer that cannot be re-created, a user fault); the first error is the one reported."""
        if self.fatal is None:
            self.fatal = error
            self.failing.set()
            for wake in self._on_fail:
                wake()

    def on_fail(self, wake: Callable[[], None]) -> None:
        """``wake()`` when the run fails (e.g. the loop waiting for a batch)."""
        self._on_fail.append(wake)
