"""Generate timeouts that follow the model (``rollout.generate_timeout_s: auto``).

A fixed timeout fails a healthy run whenever the work queued on an engine takes longer than it: a 135M model
on one CPU thread, 32 rollouts and a 100-seed evaluation sharing it, took over 60 s per call and every eval call
failed. A timeout is there to find an engine that is stuck, not one that is busy: here a call fails only when its
engine has answered no call for longer than the work owed to it should take, that is the tokens still owed by
every call in flight on it (``max_tokens`` each, an upper bound) at its measured throughput, times a slack, never
less than the floor. The budget is asked again whenever it runs out, so calls that joined the same engine batch
later (it answers them all together) extend it. The throughput is measured from this side (tokens answered per
second while the engine had work): it includes the dispatch around the engine and follows a slower engine (a
loaded machine, longer prompts) within a window. No Dask here; testable with a clock.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

FLOOR_S = 60.0  # never less than the old fixed default
FIRST_S = 600.0  # before an engine has answered anything: its speed is not known yet (and the first batch warms it)
SLACK = 4.0  # the budget over the expected time: max_tokens is an upper bound already, this covers a slow phase
WINDOW_S = 120.0  # busy seconds after which older measurements weigh half


class GenerateTimeouts:
    def __init__(self, fixed: float | str = "auto", clock=time.monotonic, floor_s: float = FLOOR_S, first_s: float = FIRST_S):
        self.fixed = None if fixed == "auto" else float(fixed)
        self.floor_s, self.first_s = floor_s, first_s
        self.clock = clock
        self.owed: Counter = Counter()  # engine → tokens its calls in flight may still generate
        self.calls: Counter = Counter()  # engine → calls in flight
        self.tokens: Counter = Counter()  # engine → tokens answered (decayed)
        self.busy: Counter = Counter()  # engine → seconds with a call in flight (decayed)
        self._since: dict[str, float] = {}  # engine → when its busy time was last added up
        self.answered_at: dict[str, float] = {}  # engine → when it last answered a call

    def rate(self, engine: str) -> float | None:
        """The engine's measured tokens/s while it had work (None before it answered anything)."""
        return self.tokens[engine] / self.busy[engine] if self.tokens[engine] > 0 and self.busy[engine] > 0 else None

    def budget(self, engine: str, max_tokens: int) -> float:
        """The timeout of a call about to go to ``engine`` (call ``start`` with it next)."""
        if self.fixed is not None:
            return self.fixed
        rate = self.rate(engine)
        if rate is None:
            return self.first_s
        return max(self.floor_s, SLACK * (self.owed[engine] + max_tokens) / rate)

    def start(self, engine: str, max_tokens: int) -> float:
        timeout = self.budget(engine, max_tokens)
        self._tick(engine)
        self.owed[engine] += max_tokens
        self.calls[engine] += 1
        return timeout

    async def wait(self, call: asyncio.Future, engine: str, started: float):
        """The answer of ``call`` (issued to ``engine`` at ``started``, after ``start``); with auto timeouts, TimeoutError
        (and ``call`` cancelled) once the engine has answered nothing for longer than its budget."""
        try:
            while self.fixed is None:  # (a fixed timeout is the dispatcher's, on the whole call)
                quiet_since = max(started, self.answered_at.get(engine, started))
                left = quiet_since + self.budget(engine, 0) - self.clock()
                if left <= 0:
                    raise TimeoutError(
                        f"generate on {engine}: the engine answered no call within its budget (rollout.generate_timeout_s="
                        f"auto)\n{self.clock() - quiet_since:.0f} s without an answer, {self.owed[engine]} tokens owed, "
                        f"{self.rate(engine) or 0:.1f} tokens/s measured"
                    )
                done, _ = await asyncio.wait({call}, timeout=left)
                if done:
                    return call.result()
            return await call
        finally:
            if not call.done():
                call.cancel()

    def done(self, engine: str, max_tokens: int, tokens: int, answered: bool = True) -> None:
        """A call ended: ``tokens`` it generated; ``answered`` False when it failed or timed out."""
        self._tick(engine)
        if answered:
            self.answered_at[engine] = self.clock()
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
