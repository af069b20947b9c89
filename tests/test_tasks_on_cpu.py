"""The pure parts of the worker-side tasks: when a streamed item may run in its batch's own thread."""

from rollart_dask.data.tasks import Speed, speed


def test_only_a_kind_seen_to_be_fast_runs_inline_and_one_slow_item_sends_it_back_to_the_pool():
    pace = Speed(fast_s=0.0005)
    assert not pace.fast  # never timed: handed off
    for _ in range(5):
        pace.add(0.0001)
    assert pace.fast
    pace.add(0.5)  # one slow item (it held its batch back once)
    assert not pace.fast  # the next batches hand this kind off
    for _ in range(200):
        pace.add(0.0001)
    assert pace.fast  # fast again once its recent calls are


def test_each_kind_is_timed_apart():
    fast, slow = speed("envhost", "step", "FrozenLakeText"), speed("envhost", "step", "CodeSandbox")
    assert fast is speed("envhost", "step", "FrozenLakeText") and fast is not slow
    fast.add(0.0001)
    slow.add(2.0)
    assert fast.fast and not slow.fast


def test_a_kind_that_looks_slow_only_in_the_crowded_pool_is_timed_alone_and_then_runs_inline():
    pace = Speed(fast_s=0.0005)
    for _ in range(50):
        pace.add(0.0012)  # 1.2 ms in the pool: waits for the GIL among busy threads
    assert not pace.fast
    probes = [pace.probe() for _ in range(64)]
    assert sum(probes) == 64 // Speed.PROBE_EVERY  # now and then, not always
    pace.add(0.00005, alone=True)  # timed alone it takes 50 µs
    assert pace.fast
    pace.add(0.3, alone=True)  # and one slow item alone sends it back to the pool
    assert not pace.fast


def test_a_slow_kind_and_one_never_inline_are_never_probed():
    slow, never = Speed(), Speed(fast_s=0.0)
    slow.add(0.05)
    never.add(0.00001)
    assert not any(slow.probe() or never.probe() for _ in range(100))
