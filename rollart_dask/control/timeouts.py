"""Generate timeouts that follow the model (``rollout.generate_timeout_s: auto``).

A fixed timeout fails a healthy run whenever the work queued on an engine takes longer than it: a 135M model
on one CPU thread, 32 rollouts and a 100-seed evaluation sharing it, took over 60 s per call and every eval call
failed. Here a call's budget is what it waits behind: the tokens still owed by the calls in flight on its engine
plus its own ``max_tokens``, at the engine's measured throughput, times a slack; never below the floor. The
throughput is measured from this side (tokens answered per second while the engine had work), so it includes
the dispatch around the engine and follows a slower engine (a loaded machine, a longer prompt) within a window.
Pure: no Dask, testable with a clock.
"""
from __future__ import annotations

import time
from collections import Counter

FLOOR_S = 60.0  # never less than the old fixed default
FIRST_S = 600.0  # before an engine has answered anything: its speed is not known yet (and the first batch warms it)
SLACK = 4.0  # the budget over the expected time: max_tokens is an upper bound already, this covers a slow phase
WINDOW_S = 120.0  # busy seconds after which older measurements weigh half


class GenerateTimeouts:
    def __init__(self, fixed: float | str = "auto", clock=time.monotonic):
        self.fixed = None if fixed == "auto" else float(fixed)
        self.clock = clock
        self.owed: Counter = Counter()  # engine → tokens its calls in flight may still generate
        self.calls: Counter = Counter()  # engine → calls in flight
        self.tokens: Counter = Counter()  # engine → tokens answered (decayed)
        self.busy: Counter = Counter()  # engine → seconds with a call in flight (decayed)
        self._since: dict[str, float] = {}  # engine → when its busy time was last added up

    def rate(self, engine: str) -> float | None:
        """The engine's measured tokens/s while it had work (None before it answered anything)."""
        return self.tokens[engine] / self.busy[engine] if self.tokens[engine] > 0 and self.busy[engine] > 0 else None

    def budget(self, engine: str, max_tokens: int) -> float:
        """The timeout of a call about to go to ``engine`` (call ``start`` with it next)."""
        if self.fixed is not None:
            return self.fixed
        rate = self.rate(engine)
        if rate is None:
            return FIRST_S
        return max(FLOOR_S, SLACK * (self.owed[engine] + max_tokens) / rate)

    def start(self, engine: str, max_tokens: int) -> float:
        timeout = self.budget(engine, max_tokens)
        self._tick(engine)
        self.owed[engine] += max_tokens
        self.calls[engine] += 1
        return timeout

    def done(self, engine: str, max_tokens: int, tokens: int) -> None:
        """A call ended (answered, failed or timed out): ``tokens`` it generated (0 when it failed)."""
        self._tick(engine)
        self.owed[engine] -= max_tokens
        self.calls[engine] -= 1
        self.tokens[engine] += tokens
        if self.busy[engine] > WINDOW_S:
            self.tokens[engine] /= 2
            self.busy[engine] /= 2

    def _tick(self, engine: str) -> None:
        now = self.clock()
        if self.calls[engine] > 0:
            self.busy[engine] += now - self._since.get(engine, now)
        self._since[engine] = now

    def summary(self) -> dict:
        return {e: round(r, 1) for e in self.tokens if (r := self.rate(e)) is not None}
