"""Accounting: whatever happens to a trajectory (finished, failed, redundant, stale, its group dropped), it ends
in exactly one outcome, and the trained ones are exactly those that went into a batch — driven through random
event sequences of the pure SampleBuffer."""

import random

import pytest

from rollart_dask.control.buffer import OUTCOMES, SampleBuffer
from rollart_dask.types import Trajectory


def drive(seed: int, fairness: str = "none", steps: int = 40) -> tuple[SampleBuffer, list[str]]:
    rng = random.Random(seed)
    buf = SampleBuffer(group_size=4, redundancy=rng.choice([0, 2]), alpha=rng.choice([0, 1, 2]), max_relaunch=2, fairness=fairness)
    running: dict[str, int] = {}  # trajectory id → start version
    trained, version = [], 0

    def carry(orders):
        for gid, tid in orders.launch:
            running[tid] = version
            buf.started(tid, version)
        for tid in orders.cancel:
            running.pop(tid, None)

    for step in range(steps):
        for _ in range(rng.randint(0, 2)):
            carry(buf.open_group(f"g{buf.opened}", rng.choice(["a", "b"]), rng.randrange(100)))
        for tid in rng.sample(sorted(running), k=min(len(running), rng.randint(0, 6))):
            if tid not in running:
                continue  # cancelled by an earlier event of this round
            start = running.pop(tid)
            if rng.random() < 0.15:
                carry(buf.failed(tid))
            else:
                gid = tid.rsplit("/", 1)[0]
                carry(buf.finished(Trajectory(id=tid, group_id=gid, task="a", seed=0, version=start, reward=1.0)))
        if rng.random() < 0.3:
            version += 1
            carry(buf.enforce_staleness(version))
        taken = buf.take(1)
        if taken:
            trained += [t.id for g in taken for t in g.kept]
    return buf, trained


@pytest.mark.parametrize("fairness", ["none", "task"])
@pytest.mark.parametrize("seed", range(12))
def test_every_launched_trajectory_ends_in_exactly_one_outcome(seed, fairness):
    buf, trained = drive(seed, fairness)
    acc = buf.account()
    assert acc["launched"] > 0 and acc["unaccounted"] == 0 and acc["conflicts"] == 0, acc
    assert sum(acc[k] for k in OUTCOMES) == acc["launched"]
    assert len(trained) == len(set(trained))  # nothing trained twice
    assert sorted(t for t, o in buf.ledger.items() if o == "trained") == sorted(trained)


def test_the_outcomes_are_the_events_that_happened():
    buf = SampleBuffer(group_size=2, redundancy=1, alpha=0, max_relaunch=0)
    orders = buf.open_group("g0", "a", 1)
    (_, a), (_, b), (_, c) = orders.launch
    for t in (a, b, c):
        buf.started(t, 0)
    buf.finished(Trajectory(id=a, group_id="g0", task="a", seed=1, version=0))
    buf.finished(Trajectory(id=b, group_id="g0", task="a", seed=1, version=0))  # c is redundant now
    assert buf.ledger == {c: "redundant"}
    orders = buf.open_group("g1", "a", 2)
    (_, d), (_, e), (_, f) = orders.launch
    for t in (d, e, f):
        buf.started(t, 0)
    buf.failed(d)  # the redundant member covers it; a second failure drops the group (max_relaunch 0)
    buf.failed(e)
    assert buf.ledger[d] == buf.ledger[e] == "failed" and buf.ledger[f] == "dropped_with_group"
    assert [t.id for g in buf.take(1) for t in g.kept] == [a, b]
    acc = buf.account()
    assert (acc["trained"], acc["redundant"], acc["failed"], acc["dropped_with_group"], acc["unaccounted"]) == (2, 1, 2, 1, 0)
