"""The runtime on a real local Dask cluster with pool resources (Nanny workers, CPU only).

One cluster is shared by the test modules (the session fixture ``address``) and reached by
address, which is also the `--scheduler` attach path. Tests that break workers start their own.
"""

import asyncio
import time

import pytest
import torch

from rollart_dask.resource.cluster import connect
from rollart_dask.config import load_flow
from rollart_dask.control.run import Run
from rollart_dask.resource.pools import PoolError
from tests.conftest import await_for, check_staleness_by_turns, close, flow_dict, record_trained_batches, start_run

POOL_OF_WORKER = {"train-0": "TRAIN", "h800-0": "H800", "h20-0": "H20", "cpu-0": "CPU", "cpu-1": "CPU", "reward-0": "REWARD"}


EXPECTED = {
    "generate": {"h800-0"},
    "env-reset": {"cpu-0", "cpu-1"},
    "env-step": {"cpu-0", "cpu-1"},
    "reward": {"reward-0"},
    "train": {"train-0"},
    "publish-weights": {"train-0"},
    "weights-bucket": {"train-0"},
    "stage-weights": {"h800-0"},
    "update-weights": {"h800-0"},
    "checkpoint": {"train-0"},
}


def stages_by_worker(stream, names) -> dict[str, set]:
    seen: dict[str, set] = {}
    for rec in stream:
        key = rec["key"][0] if isinstance(rec["key"], tuple) else rec["key"]  # ("stage-<span id>", "<id>") inside a span
        prefix = key.rsplit("-", 1)[0] if isinstance(key, str) else str(key)
        seen.setdefault(prefix, set()).add(names[rec["worker"]])
    return seen


def test_each_task_lands_on_its_pool(address, tmp_path, model_dir, run_async):
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            await client.get_task_stream(start=time.time())  # installs the recorder
            t0 = time.time()
            result = await run.run()
            info = await client.scheduler.identity()
            names = {a: w["name"] for a, w in info["workers"].items()}

            async def seen_so_far():  # the workers report their batches (no Dask tasks) about once a second
                seen = stages_by_worker(await client.get_task_stream(start=t0), names)
                return seen if EXPECTED.keys() <= seen.keys() else None

            seen = await await_for(seen_so_far, timeout=30, what=f"every stage of {sorted(EXPECTED)} in the task stream")
            return result, seen
        finally:
            await close(run, client, cluster)

    result, seen = run_async(go())
    assert result["steps"] == 2
    for stage, workers in EXPECTED.items():
        assert stage in seen, f"no {stage} task ran; saw {sorted(seen)}"
        assert seen[stage] <= workers, f"{stage} ran on {seen[stage]}, expected {workers}"


def test_missing_pool_fails_fast_naming_it(tmp_path, model_dir, run_async):
    data = flow_dict()
    data["cluster"]["workers"] = [w for w in data["cluster"]["workers"] if w["name"] not in ("reward-0", "h800-0")]
    cfg = load_flow(data=data)

    async def go():
        client, cluster = await connect(cfg.cluster)
        try:
            t0 = time.monotonic()
            with pytest.raises(PoolError) as e:
                await Run(cfg, client, tmp_path, model_dir).setup()
            return str(e.value), time.monotonic() - t0
        finally:
            await client.close()
            await cluster.close()

    msg, took = run_async(go())
    assert "pool REWARD (reward (local)) has no worker" in msg
    assert "pool H800 (engine for task frozenlake" in msg
    assert "train-0[H800+TRAIN]" in msg  # the trainer's H800 tag does not count as an engine
    assert took < 10


def test_group_samples_are_distinct_and_weight_update_changes_outputs(address, tmp_path, model_dir, run_async):
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address, "rollout.coalesce": False}))
    prompt = "SFFF\nFPFH\nFFFH\nHFFG"

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            p = run.services.proxy
            before_futures = run.d.futures
            group = await asyncio.gather(*(p.generate(f"g/{i}", "H800", prompt, list("LDRU"), 2, 1.0) for i in range(8)))
            n_futures = run.d.futures - before_futures
            greedy0 = await p.generate("probe0", "H800", prompt, list("LDRU"), 2, 0.0)
            # one real training step on the trainer worker, published and pulled by the engine
            samples = [
                {
                    "prompt_ids": c.prompt_ids,
                    "response_ids": c.token_ids,
                    "logprobs": c.logprobs,
                    "allowed_ids": c.allowed_ids,
                    "advantage": 1.0 if c.text == "L" else -1.0,
                }
                for c in group
            ]
            from rollart_dask.data import tasks

            tf = run.d.submit_one("train", tasks.trainer_step, samples, pool="TRAIN", worker=run.services.trainer)
            metrics = await tf
            run.services.weights.publish(metrics["version"], p.pool_of, after=tf)
            await p.suspend()
            transfer = await run.services.weights.wait_staged()
            await p.update_weights(metrics["version"])
            p.resume()
            assert transfer["version"] == 1 and transfer["bytes"] > 0 and transfer["engines"] == len(p.pool_of)
            greedy1 = await p.generate("probe1", "H800", prompt, list("LDRU"), 2, 0.0)
            return group, n_futures, greedy0, greedy1
        finally:
            await close(run, client, cluster)

    group, n_futures, g0, g1 = run_async(go())
    assert n_futures == 8  # pure=False: eight samples of one prompt are eight tasks, not one merged
    assert len({c.request_id for c in group}) == 8
    assert len({c.text for c in group}) > 1  # random-init model at temperature 1: the samples differ
    assert g0.version == 0 and g1.version == 1
    assert g0.logprobs != g1.logprobs  # the engine runs the new weights


def test_suspend_resume_loses_and_duplicates_nothing(address, tmp_path, model_dir, run_async):
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            p = run.services.proxy
            calls = [asyncio.ensure_future(p.generate(f"t/{i}", "H800", "hello world " * 8, None, 300, 1.0)) for i in range(24)]
            await asyncio.sleep(0.05)
            held = 0
            for _ in range(3):  # suspend while requests are decoding: they are aborted, then re-issued after resume
                await p.suspend()
                assert not p._inflight
                pending, requests = [c for c in calls if not c.done()], p.requests
                held += len(pending)
                await asyncio.sleep(0.5)
                # while suspended no call completes and no request reaches an engine: the aborted ones wait for Resume
                assert not [c for c in pending if c.done()], "a call completed while the engines were suspended"
                assert p.requests == requests and not p._inflight, "a request was issued while the engines were suspended"
                p.resume()
                await asyncio.sleep(0.3)
            assert held > 0  # the suspensions did hold calls back
            done = await asyncio.gather(*calls)
            result = await run.run()  # and through whole steps, with Suspend/Update/Resume each step
            return done, p.reissued, run.trained_ids, result
        finally:
            await close(run, client, cluster)

    done, reissued, trained, result = run_async(go())
    assert len(done) == 24 and all(c.finish_reason in ("stop", "length") for c in done)
    assert all(len(c.token_ids) > 0 for c in done)
    assert reissued > 0  # suspend really caught requests in flight
    assert len(trained) == len(set(trained)) == 2 * 2 * 4  # steps x groups x G, none twice
    assert result["steps"] == 2


@pytest.mark.parametrize("mode", ["sync", "one_off", "rollart"])
def test_modes_train_and_publish(address, tmp_path, model_dir, run_async, mode):
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address, "rollout.mode": mode, "rollout.alpha": None, "trainer.steps": 3}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            batches = record_trained_batches(run)
            return await run.run(), run.metrics.rows, batches
        finally:
            await close(run, client, cluster)

    result, rows, batches = run_async(go())
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["version"] for r in steps] == [1, 2, 3]
    alpha = {"sync": 0, "one_off": 1, "rollart": 1}[mode]
    check_staleness_by_turns(batches, steps, alpha)  # against the versions the engines stamped on every turn
    for r in steps:
        assert max(int(k) for k in r["staleness"]) <= alpha
        assert r["samples"] > 0 and r["tokens"] > 0
    assert result["last"]["version"] == 3
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(result["checkpoint"]).state_dict()  # an HF checkpoint transformers loads
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert trained.keys() == initial.keys()
    assert [k for k in initial if not torch.equal(trained[k], initial[k])]  # ...holding the trained weights, not the initial ones


@pytest.mark.parametrize("alpha", [1, 2])
def test_eager_admission_trains_nothing_older_than_alpha_by_the_engines_version_stamps(address, tmp_path, model_dir, run_async, alpha):
    """Eager admission (the paper's R4) with torch engines: trajectories outlive the bound and are aborted or evicted;
    what trains at version n started at ≥ n − α by the version the engine stamped on its first turn. Env steps are
    slowed (EMULATED latency, 0.2 s) so that trajectories are in flight across weight swaps. With α = 2 some trained
    trajectories have turns on both sides of a swap; with α = 1 none can: a batch is taken before the engines install
    the version it trains at, so its trajectories ran entirely at n − 1."""
    task = {**flow_dict()["tasks"][0], "inject": {"step_latency": {"dist": "constant", "s": 0.2}}}
    cfg = load_flow(
        data=flow_dict(
            **{"cluster.scheduler": address, "rollout.admission": "eager", "rollout.alpha": alpha, "trainer.steps": 5, "tasks": [task]}
        )
    )

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            batches = record_trained_batches(run)
            return await run.run(), run.metrics.rows, batches
        finally:
            await close(run, client, cluster)

    result, rows, batches = run_async(go())
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["version"] for r in steps] == [1, 2, 3, 4, 5] and result["steps"] == 5
    spanning = check_staleness_by_turns(batches, steps, alpha)
    assert all(len(b) == 2 * 4 for b in batches)  # batch_groups × G trajectories per step
    assert result["counts"].get("aborted_stale", 0) + result["counts"].get("evicted_stale", 0) > 0  # the bound did bite
    if alpha >= 2:
        assert spanning > 0, "no trained trajectory had turns on both sides of a weight swap"


def test_killing_an_env_worker_loses_no_sample(tmp_path, model_dir, run_async):
    cfg = load_flow(data=flow_dict(**{"trainer.steps": 4, "rollout.batch_groups": 3}))
    killed = {}

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)

        def on_step(r):
            if r.published == 1 and not killed:
                addr = next(a for a, w in r.services.poolmap.workers.items() if w["name"] == "cpu-0")
                killed["addr"] = addr

                async def die():  # the worker process exits hard; its Nanny starts a fresh one
                    import os

                    os._exit(1)

                asyncio.ensure_future(client.run(die, workers=[addr], wait=False))

        try:
            result = await run.run(on_step=on_step)
            return result, run.trained_ids
        finally:
            await close(run, client, cluster)

    result, trained = run_async(go(), timeout=400)
    assert killed and result["steps"] == 4
    counts = result["counts"]
    assert counts.get("workers_lost", 0) >= 1
    assert counts.get("worker_lost", 0) >= 1 and counts.get("relaunched", 0) >= counts["worker_lost"]
    assert counts.get("groups_dropped", 0) == 0
    assert len(trained) == len(set(trained)) == 4 * 3 * 4  # every batch full: lost trajectories were restarted elsewhere


@pytest.mark.needs("vllm")
def test_vllm_engine_service_in_a_run(address, tmp_path, model_dir, run_async):
    cfg = load_flow(data=flow_dict(**{"cluster.scheduler": address, "engine.backend": "vllm", "trainer.steps": 2}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            return run.services.engine_backend, await run.run(), run.metrics.rows
        finally:
            await close(run, client, cluster)

    backend, result, rows = run_async(go())
    steps = [r for r in rows if r["kind"] == "step"]
    assert backend == "vllm" and result["steps"] == 2
    assert steps[-1]["update_s"] > 0 and result["last"]["version"] == 2  # weights reached the vLLM engine in place


def test_a_lost_trainer_is_re_created_where_it_stood_and_the_run_goes_on(tmp_path, model_dir, run_async):
    """Its worker killed after step 3 (a Train in flight): the restarted worker's trainer restores the checkpoint of
    step 2, replays step 3 and trains step 4 again; its weights are bit for bit the lost trainer's."""
    cfg = load_flow(data=flow_dict(**{"trainer.steps": 6, "trainer.checkpoint_every": 2}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        killed = []

        def on_step(r):
            if r.published == 3 and not killed:
                killed.append(r.services.trainer)

                async def die():
                    import os

                    os._exit(1)

                asyncio.ensure_future(client.run(die, workers=[r.services.trainer], wait=False))

        try:
            return await run.run(on_step=on_step), killed, run.services.trainer
        finally:
            await close(run, client, cluster)

    result, killed, trainer = run_async(go(), timeout=300)
    counts, acct = result["counts"], result["accounting"]
    assert result["steps"] == 6 and result["last"]["version"] == 6 and trainer != killed[0]
    assert counts["trainer_recovered"] == 1 and counts["trainer_replay_identical"] == 1, counts
    assert counts["steps_redone"] >= 1 and acct["trained"] == 6 * 2 * 4  # every batch trained once into the trainer that went on
    assert acct["unaccounted"] == acct["trained_twice"] == 0, acct


def test_a_trainer_that_cannot_be_re_created_ends_the_run_promptly_with_a_clear_error(tmp_path, model_dir, run_async):
    """The trainer's worker lost for good and no other TRAIN worker: the run ends once rollout.worker_wait_s is out."""
    from rollart_dask.tools.chaos.faults import Injector
    from rollart_dask.tools.chaos.scenarios import TRAINER, Scenario

    cfg = load_flow(data=flow_dict(**{"trainer.steps": 50, "rollout.worker_wait_s": 3}))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        run.cluster, injector = cluster, Injector(Scenario("trainer-lost", "the trainer lost for good"))
        injector.run = run

        def on_step(r):
            if r.published == 1:
                asyncio.ensure_future(injector.lose_worker(TRAINER))

        try:
            t0 = time.monotonic()
            with pytest.raises(RuntimeError) as e:
                await run.run(on_step=on_step)
            return str(e.value), time.monotonic() - t0, run.published
        finally:
            await close(run, client, cluster)

    msg, took, published = run_async(go(), timeout=300)
    assert "train-0" in msg and "could not be re-created" in msg and "--resume" in msg
    assert published < 50 and took < 120  # stopped promptly, never waited for a Train or a batch that could not come
