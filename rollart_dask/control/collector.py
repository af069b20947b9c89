"""Python's cyclic garbage collector, tuned for the length of a run.

A run keeps thousands of trajectories in flight in one process — a coroutine, futures and a
trajectory record each — and allocates a few objects per call. At the default thresholds (a young
collection every 700 allocations) the collector walks that live set again and again: at 4,096 in
flight it took about half of the client's CPU (benchmarks/control_plane.py; README, "Control-plane
overhead"). A young collection every 50,000 allocations keeps what it frees the same and its cost a
small fraction. The previous thresholds come back when the run ends (a notebook's process is the user's).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

RUN_THRESHOLDS = (50_000, 10, 10)


@contextmanager
def fewer_collections(thresholds: tuple[int, int, int] = RUN_THRESHOLDS):
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*before)
