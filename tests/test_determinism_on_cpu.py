"""rollout.deterministic, the pure parts: the flow rules, the ordered batch, seeded sampling in the torch engine and the
batch's digest (the run itself replaying: tests/test_determinism_cluster.py)."""

import pytest

from rollart_dask.algo.samples import batch_digest
from rollart_dask.algo.seeding import mixed_seed
from rollart_dask.config import FlowError, load_flow
from rollart_dask.control.buffer import SampleBuffer
from rollart_dask.data.engine_torch import TorchEngine
from rollart_dask.types import Trajectory
from tests.conftest import flow_dict


def test_a_deterministic_flow_generates_batch_by_batch_and_forwards_one_request_at_a_time():
    cfg = load_flow(data=flow_dict(**{"rollout.deterministic": True}))  # mode rollart: trajectory level unless deterministic
    assert (cfg.rollout.level, cfg.rollout.alpha, cfg.rollout.admission, cfg.engine.max_batch) == ("batch", 1, "safe", 1)
    plain = load_flow(data=flow_dict())
    assert (plain.rollout.level, plain.engine.max_batch) == ("trajectory", 1024)


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("rollout.level", "trajectory", "rollout.level=trajectory"),
        ("rollout.alpha", 2, "rollout.alpha=2"),
        ("rollout.redundancy", 1, "rollout.redundancy=1"),
        ("rollout.admission", "eager", "rollout.admission=eager"),
        ("rollout.fairness", "task", "rollout.fairness=task"),
        ("engine.backend", "vllm", "engine.backend=vllm"),
        ("trainer.backend", "megatron", "trainer.backend=megatron"),
        ("engine.max_batch", 8, "engine.max_batch=8"),
        ("cluster.scheduler", "tcp://10.0.0.1:8786", "cluster.scheduler=tcp://10.0.0.1:8786"),
    ],
)
def test_what_cannot_replay_is_refused_by_name(key, value, named):
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**{"rollout.deterministic": True, key: value}))
    assert f"rollout.deterministic with {named}" in str(e.value)
    load_flow(data=flow_dict(**{key: value}))  # alone it is a valid flow


def test_engine_workers_must_agree_on_torch_threads():
    workers = flow_dict()["cluster"]["workers"]
    workers[1] = {**workers[1], "torch_threads": 2}  # h800-0
    with pytest.raises(FlowError, match="h800-0"):
        load_flow(data=flow_dict(**{"rollout.deterministic": True, "cluster.workers": workers}))


def _traj(tid: str, reward: float = 1.0) -> Trajectory:
    return Trajectory(id=tid, group_id=tid.rsplit("/", 1)[0], task="t", seed=0, version=0, reward=reward)


def test_an_ordered_buffer_takes_groups_in_launch_order_and_members_by_index_whatever_finished_first():
    b = SampleBuffer(group_size=2, alpha=1, ordered=True)
    for g in ("a", "b", "c"):
        b.open_group(g, "t", 0)
    for tid in ("c/1", "c/0", "b/1", "b/0"):  # the later groups finish first, members in reverse
        b.finished(_traj(tid))
    assert b.take(2) is None  # a (launched first) is not complete: b and c wait for it
    b.finished(_traj("a/1"))
    b.finished(_traj("a/0"))
    taken = b.take(2)
    assert [g.id for g in taken] == ["a", "b"]
    assert [[t.id for t in g.kept] for g in taken] == [["a/0", "a/1"], ["b/0", "b/1"]]
    unordered = SampleBuffer(group_size=1, alpha=1)
    for g in ("a", "b"):
        unordered.open_group(g, "t", 0)
    unordered.finished(_traj("b/0"))
    assert [g.id for g in unordered.take(1)] == ["b"]  # (by arrival, without it)


def test_mixed_seeds_are_stable_and_tell_their_parts_apart():
    assert mixed_seed(0, 3, 1) == mixed_seed(0, 3, 1)
    seeds = {mixed_seed(0, g, m) for g in range(50) for m in range(8)} | {mixed_seed(1, g, m) for g in range(50) for m in range(8)}
    assert len(seeds) == 800 and all(0 <= s < 2**63 for s in seeds)


def _req(i: int, seed: int | None, prompt: str = "Choose a move.") -> dict:
    r = {"id": f"r{i}", "prompt": prompt, "choices": None, "max_tokens": 6, "temperature": 1.0}
    return r if seed is None else {**r, "seed": seed}


def test_a_seeded_request_samples_the_same_tokens_whatever_is_batched_beside_it_and_in_whatever_order(model_dir):
    engine = TorchEngine(str(model_dir), seed=0, max_batch=1)  # rollout.deterministic: one request per forward
    alone = engine.generate([_req(0, 11)])[0]
    others = [_req(i, 100 + i, prompt=f"Another prompt {i}.") for i in range(1, 6)]
    crowded = {c.request_id: c for c in engine.generate([*others[:3], _req(0, 11), *others[3:]])}["r0"]
    assert (crowded.token_ids, crowded.logprobs) == (alone.token_ids, alone.logprobs)
    draws = {tuple(engine.generate([_req(0, s)])[0].token_ids) for s in range(8)}
    assert len(draws) > 1  # the seed decides: other seeds, other samples
    unseeded = {tuple(engine.generate([_req(0, None)])[0].token_ids) for _ in range(8)}
    assert len(unseeded) > 1  # without one, the engine's own generator goes on drawing


def test_a_continued_request_draws_its_remaining_tokens_as_the_whole_one_did(model_dir):
    """A token's seed is its place in the response, so a turn continued from its prefix (rollout.partial=continue, or
    decoding after a prefill elsewhere) draws what the uninterrupted turn drew."""
    engine = TorchEngine(str(model_dir), seed=0, max_batch=1)
    whole = engine.generate([_req(0, 5)])[0]
    rest = engine.generate([{**_req(1, 5), "prefix_ids": whole.token_ids[:2], "max_tokens": 4}])[0]
    assert rest.token_ids == whole.token_ids[2:]


def test_the_batch_digest_changes_with_any_sample_or_their_order():
    s = [
        {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5], "version": 0, "token_versions": None, "advantage": a}
        for a in (1.0, -1.0)
    ]
    d = batch_digest(s)
    assert batch_digest([dict(x) for x in s]) == d
    assert batch_digest(s[::-1]) != d
    assert batch_digest([s[0], {**s[1], "logprobs": [-0.5000001]}]) != d
