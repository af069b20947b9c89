"""SampleBuffer: groups, redundancy, staleness, replacement — pure, no cluster."""

from rollart_dask.control.buffer import SampleBuffer
from rollart_dask.types import Trajectory


def traj(tid, version, reward=1.0):
    return Trajectory(id=tid, group_id=tid.rsplit("/", 1)[0], task="t", seed=0, version=version, reward=reward)


def test_group_launches_g_plus_r_and_keeps_first_g():
    b = SampleBuffer(group_size=3, redundancy=2, alpha=1)
    orders = b.open_group("g", "t", 7)
    ids = [t for _, t in orders.launch]
    assert len(ids) == 5 and len(set(ids)) == 5
    for t in ids:
        b.started(t, 0)
    finish_order = [ids[4], ids[1], ids[2]]
    for t in finish_order[:-1]:
        assert b.finished(traj(t, 0)).cancel == []
    last = b.finished(traj(finish_order[-1], 0))
    assert sorted(last.cancel) == sorted([ids[0], ids[3]])  # the rest are cancelled
    assert b.counts["redundant_dropped"] == 2
    groups = b.take(1)
    assert [t.id for t in groups[0].kept] == finish_order
    assert b.finished(traj(ids[0], 0)).launch == [] and b.counts["late"] == 1  # a cancelled one finishing late is ignored


def test_take_needs_enough_complete_groups():
    b = SampleBuffer(group_size=1, alpha=1)
    for g in ("a", "b"):
        b.open_group(g, "t", 0)
    b.finished(traj("a/0", 0))
    assert b.take(2) is None
    b.finished(traj("b/0", 0))
    assert [g.id for g in b.take(2)] == ["a", "b"]


def test_staleness_aborts_exactly_older_than_n_minus_alpha():
    b = SampleBuffer(group_size=1, alpha=1, max_relaunch=10)
    versions = {"v0": 0, "v1": 1, "v2": 2, "v3": 3}
    for name, v in versions.items():
        b.open_group(name, "t", 0)
        b.started(f"{name}/0", v)
    b.finished(traj("v0/0", 0))  # a finished one that is stale too
    b.finished(traj("v2/0", 2))
    orders = b.enforce_staleness(policy_version=3)  # floor = 2
    assert orders.cancel == ["v1/0"]  # running and stale
    assert b.counts["aborted_stale"] == 1 and b.counts["evicted_stale"] == 1
    relaunched = sorted(g for g, _ in orders.launch)
    assert relaunched == ["v0", "v1"]  # both replaced with fresh members
    assert [g.id for g in b.take(1)] == ["v2"]  # v2 (= floor) is kept, v3 still running
    assert b.enforce_staleness(3).cancel == []  # idempotent


def test_alpha_zero_keeps_only_current_version():
    b = SampleBuffer(group_size=1, alpha=0)
    b.open_group("g", "t", 0)
    b.started("g/0", 4)
    assert b.enforce_staleness(5).cancel == ["g/0"]


def test_a_tighter_max_trained_lag_evicts_what_alpha_would_keep():
    b = SampleBuffer(group_size=1, alpha=2, max_lag=1)
    for gid, started in (("old", 3), ("new", 4)):
        b.open_group(gid, "t", 0)
        b.started(f"{gid}/0", started)
        b.finished(traj(f"{gid}/0", started))
    evicted = b.enforce_staleness(5)  # α=2 keeps both (floor 3); the bound of 1 keeps v4 only
    assert b.counts["evicted_stale"] == 1 and [g for g, _ in evicted.launch] == ["old"]
    assert [g.id for g in b.take(1)] == ["new"]
    assert SampleBuffer(group_size=1, alpha=1, max_lag=3).max_lag == 1  # never looser than α


def test_failed_member_is_replaced_from_redundancy_first():
    b = SampleBuffer(group_size=2, redundancy=1, alpha=1)
    ids = [t for _, t in b.open_group("g", "t", 0).launch]
    assert b.failed(ids[0]).launch == []  # two still running cover G=2
    orders = b.failed(ids[1])
    assert [g for g, _ in orders.launch] == ["g"] and b.counts["relaunched"] == 1


def test_group_dropped_after_relaunch_budget():
    b = SampleBuffer(group_size=2, alpha=1, max_relaunch=1)
    ids = [t for _, t in b.open_group("g", "t", 0).launch]
    new = b.failed(ids[0]).launch
    assert len(new) == 1
    orders = b.failed(new[0][1])
    assert orders.cancel == [ids[1]] and b.counts["groups_dropped"] == 1
    assert "g" not in b.groups and b.admitted == 0


def test_admitted_counts_open_minus_dropped():
    b = SampleBuffer(group_size=1, alpha=1, max_relaunch=0)
    b.open_group("a", "t", 0)
    b.open_group("b", "t", 0)
    b.failed("a/0")
    assert b.admitted == 1


def test_a_trained_trajectorys_staleness_splits_into_its_time_in_flight_and_in_the_queue():
    b = SampleBuffer(group_size=4, alpha=2)
    ids = [t for _, t in b.open_group("g", "t", 0).launch]
    # (start version, engine version at finish, monotonic finish time) of each member; trained at version 3, time 100
    for tid, (started, finished, at) in zip(ids, [(1, 1, 99.0), (1, 2, 90.0), (2, 2, 96.0), (1, 3, 99.5)]):
        b.started(tid, started)
        t = traj(tid, started)
        t.finished_version, t.finished_at = finished, at
        b.finished(t)
    groups = b.take(1)
    lag = b.lag(3, groups, now=100.0)
    assert sorted(b.staleness(3, groups)) == [1, 2, 2, 2]  # the whole: in flight + in the queue, per trajectory
    assert lag["lag_in_flight_max"] == 2 and lag["lag_in_flight_p50"] == 0 and lag["lag_in_flight_p90"] == 2  # 0, 1, 0, 2
    assert lag["lag_in_queue_max"] == 2 and lag["lag_in_queue_p50"] == 1  # 2, 1, 1, 0
    assert lag["queue_s_max"] == 10.0 and lag["queue_s_p50"] == 1.0 and lag["queue_s_p90"] == 10.0  # 1, 10, 4, 0.5
    assert lag["lag_hist"] == {"in_flight": {"0": 2, "1": 1, "2": 1}, "in_queue": {"0": 1, "1": 2, "2": 1}}  # for the page
    assert b.lag(3, [], now=100.0) == {}  # nothing trained: no figures rather than zeros


def test_the_trainer_drops_a_sample_with_any_token_past_the_lag_bound():
    from rollart_dask.algo.samples import within_lag

    samples = [
        {"version": 4, "token_versions": None, "response_ids": [1, 2]},  # lag 1
        {"version": 5, "token_versions": [3, 4, 5], "response_ids": [1, 2, 3]},  # continued: its first token lags 2
        {"version": 5, "token_versions": None, "response_ids": [1]},  # lag 0
    ]
    kept, dropped = within_lag(samples, trainer_version=5, bound=1)
    assert kept == [samples[0], samples[2]] and dropped == 1
    assert within_lag(samples, 5, 2) == (samples, 0) and within_lag(samples, 5, 0) == ([samples[2]], 2)
