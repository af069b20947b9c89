"""Weight stores on a real cluster: the Mooncake store on the embedded default (its own local
mooncake_master), and publish / pull / garbage collection against a master the flow names."""

import asyncio
import json
import subprocess
import time

import pytest

from rollart_dask.config import load_flow

from conftest import close, flow_dict, start_run

# weights.store=mooncake needs the mooncake extra and Debian's libibverbs1 (the Makefile installs both): its tests are
# skipped without them, a failure in CI on x86-64 (tests/conftest.py)
needs_mooncake = pytest.mark.needs("libibverbs")


def _masters() -> int:
    return len(subprocess.run(["pgrep", "-f", "mooncake_master"], capture_output=True, text=True).stdout.split())


@needs_mooncake
def test_mooncake_store_on_the_embedded_default_publishes_pulls_and_stops_its_master(tmp_path, run_async):
    from rollart_dask.entry.api import run_flow

    cfg = load_flow(
        data=flow_dict(
            **{
                "weights.store": "mooncake",
                "weights.mooncake.segment_mb": 64,
                "weights.mooncake.buffer_mb": 32,
                "weights.bucket_mb": 1,
                "trainer.steps": 3,
            }
        )
    )
    before = _masters()
    result = run_async(run_flow(cfg, tmp_path), timeout=400)
    assert _masters() == before  # the run's master is gone with the run
    assert (tmp_path / "mooncake_master.log").stat().st_size > 0
    w = result["weights"]
    assert w["store"] == "mooncake" and w["transfers"] >= 2 and w["bytes"] > 200_000 and w["engines"] >= 1
    assert 0 <= w["waited_s"] <= w["transfer_s"] and 0 <= w["hidden_fraction"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    synced = [r["weights"] for r in rows if r.get("kind") == "step" and "weights" in r]
    assert synced and all(s["store"] == "mooncake" and s["buckets"] >= 1 for s in synced)
    assert result["last"]["version"] == 3  # the engines run the last published version


@needs_mooncake
def test_publish_stage_swap_and_garbage_collection_against_a_named_master(address, tmp_path, model_dir, run_async):
    from mooncake.store import MooncakeDistributedStore

    from rollart_dask.data.weights.mooncake import LocalMaster

    master = LocalMaster(tmp_path / "master.log").start()
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "weights.store": "mooncake",
                "weights.bucket_mb": 0.05,
                "weights.mooncake.master": master.master,
                "weights.mooncake.metadata_server": master.metadata_server,
                "weights.mooncake.segment_mb": 64,
                "weights.mooncake.buffer_mb": 32,
            }
        )
    )
    probe = MooncakeDistributedStore()
    assert probe.setup("127.0.0.1", master.metadata_server, 16 << 20, 16 << 20, "tcp", "", master.master) == 0

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            assert run.services.weights.master is None  # named master: the run starts none
            rows = []
            for version in (1, 2, 3):
                run.services.weights.publish(version, run.services.proxy.pool_of)
                rows.append(await run.services.weights.wait_staged())
                await run.services.proxy.update_weights(version)
            keys = {v: [f"{run.services.weights.prefix}/v{v}/b{i}" for i in range(rows[0]["buckets"])] for v in (1, 2, 3)}
            present = {v: [probe.is_exist(k) == 1 for k in ks] for v, ks in keys.items()}
            return rows, present
        finally:
            await close(run, client, cluster)

    try:
        rows, present = run_async(go())
    finally:
        probe.close()
        master.stop()
    assert [r["version"] for r in rows] == [1, 2, 3] and rows[0]["buckets"] > 1  # 50 KiB buckets of a ~200 KiB model
    assert not any(present[1]) and all(present[2]) and all(present[3])  # keep_versions=2: v1 collected at v3's publish


def _weights_digest(name):  # (sent by value) the weights of the trainer or engine service on this worker
    import hashlib

    from rollart_dask.data import tasks

    h = hashlib.sha256()
    for k, v in sorted(tasks.service(name).model.state_dict().items()):
        if not k.endswith("lm_head.weight"):  # tied to the embedding
            h.update(k.encode() + v.detach().float().numpy().tobytes())
    return h.hexdigest()


def test_a_staged_version_holds_the_weights_it_was_published_with_not_the_next_trains(tmp_path, model_dir, run_async):
    """The loop submits Train n+1 before the engines have pulled version n: the publish must have read
    the weights first (Train is ordered after it), and the engines must end up with exactly those.
    The trainer's worker runs two tasks at once here, so only that ordering keeps them apart."""
    from rollart_dask.data import plugins, tasks

    data = flow_dict()
    data["cluster"]["workers"][0]["nthreads"] = 2
    cfg = load_flow(data=data)
    prompt = "SFFF\nFPFH\nFFFH\nHFFG"
    digest = _weights_digest

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            p = run.services.proxy
            group = await asyncio.gather(*(p.generate(f"g/{i}", "H800", prompt, list("LDRU"), 2, 1.0) for i in range(8)))
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
            trainer_at_v0 = await run.d.submit_one("probe", digest, plugins.TRAINER, pool="TRAIN", worker=run.services.trainer)
            await client.get_task_stream(start=time.time())  # installs the recorder
            t0 = time.time()
            run.services.weights.publish(1, p.pool_of)  # publish the current weights as "v1"; the next Train is submitted at once
            train = run.d.submit_one(
                "train", tasks.trainer_step, samples, run.services.weights.publishing, pool="TRAIN", worker=run.services.trainer
            )
            await train
            trainer_after = await run.d.submit_one("probe", digest, plugins.TRAINER, pool="TRAIN", worker=run.services.trainer)
            await run.services.weights.wait_staged()
            await p.update_weights(1)
            engine = next(iter(p.pool_of))
            engine_at_v1 = await run.d.submit_one("probe", digest, plugins.ENGINE, pool=p.pool_of[engine], worker=engine)
            computed = {}
            for rec in await client.get_task_stream(start=t0):
                stage = (rec["key"][0] if isinstance(rec["key"], tuple) else rec["key"]).rsplit("-", 1)[0]
                computed[stage] = next(s for s in rec["startstops"] if s["action"] == "compute")
            return trainer_at_v0, trainer_after, engine_at_v1, computed
        finally:
            await close(run, client, cluster)

    trainer_at_v0, trainer_after, engine_at_v1, computed = run_async(go())
    assert computed["train"]["start"] >= computed["publish-weights"]["stop"]  # never alongside the publish, on two threads
    assert trainer_after != trainer_at_v0  # the Train changed the weights...
    assert engine_at_v1 == trainer_at_v0  # ...after the publish had read them: the engine runs what was published


@pytest.mark.slow
@pytest.mark.parametrize("store", ["dask", pytest.param("mooncake", marks=needs_mooncake)])
def test_with_lora_the_adapter_alone_crosses_the_store_and_the_engines_base_is_untouched(store, tmp_path, model_dir, run_async):
    from rollart_dask.data import plugins, tasks

    cfg = load_flow(
        data=flow_dict(
            **{
                "weights.store": store,
                "trainer.lora": {"r": 4},
                "trainer.lr": 0.05,
                "weights.bucket_mb": 1,
                "weights.mooncake.segment_mb": 64,
                "weights.mooncake.buffer_mb": 32,
            }
        )
    )
    prompt = "SFFF\nFPFH\nFFFH\nHFFG"

    def digests(name):  # (sent by value) the adapter's and the base's weights of the service on this worker
        import hashlib

        h = {"adapter": hashlib.sha256(), "base": hashlib.sha256()}
        for k, v in sorted(tasks.service(name).model.state_dict().items()):
            h["adapter" if "lora_" in k else "base"].update(k.encode() + v.detach().float().numpy().tobytes())
        return {k: d.hexdigest() for k, d in h.items()}

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            p = run.services.proxy
            engine = next(a for a, pool in p.pool_of.items() if pool == "H800")
            probe = lambda name, **kw: run.d.submit_one("probe", digests, name, **kw)  # noqa: E731
            engine_before = await probe(plugins.ENGINE, pool="H800", worker=engine)
            group = await asyncio.gather(*(p.generate(f"g/{i}", "H800", prompt, list("LDRU"), 2, 1.0) for i in range(8)))
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
            await run.d.submit_one("train", tasks.trainer_step, samples, pool="TRAIN", worker=run.services.trainer)
            trainer = await probe(plugins.TRAINER, pool="TRAIN", worker=run.services.trainer)
            run.services.weights.publish(1, p.pool_of)
            row = await run.services.weights.wait_staged()
            await p.update_weights(1)
            return engine_before, trainer, await probe(plugins.ENGINE, pool="H800", worker=engine), row
        finally:
            await close(run, client, cluster)

    before, trainer, after, row = run_async(go())
    assert row["store"] == store and row["adapter"] is True
    assert after["adapter"] == trainer["adapter"] != before["adapter"]  # the trained adapter, swapped in
    assert after["base"] == before["base"] == trainer["base"]  # the base never moved, on either side
    full_bytes = sum(p.numel() * 4 for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())
    assert 0 < row["bytes"] < full_bytes / 2  # (r=4 on every projection of the test's 64-wide model)


def _forget_the_base(dask_worker=None):  # as an engine that lost the version it held would
    from rollart_dask.data.weights import worker

    worker._base.clear()


@pytest.mark.parametrize("store", ["dask", pytest.param("mooncake", marks=needs_mooncake)])
def test_with_weights_delta_engines_pull_each_versions_change_and_hold_the_trainers_weights_bit_for_bit(
    store, address, tmp_path, model_dir, run_async
):
    from rollart_dask.data import plugins

    over = {"weights.delta": True, "weights.store": store, "trainer.steps": 5, "weights.bucket_mb": 0.05}
    if store == "dask":  # (a mooncake master the run starts is reached on this machine only: the embedded default)
        over["cluster.scheduler"] = address
    over.update({"weights.mooncake.segment_mb": 64, "weights.mooncake.buffer_mb": 32, "eval.seeds": 2})
    cfg = load_flow(data=flow_dict(**over))

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            result = await run.run()
            s, p = run.services, run.services.proxy
            probe = lambda name, pool, at: run.d.submit_one("probe", _weights_digest, name, pool=pool, worker=at)  # noqa: E731
            trainer = await probe(plugins.TRAINER, "TRAIN", s.trainer)
            engines = {a: await probe(plugins.ENGINE, pool, a) for a, pool in p.pool_of.items()}
            fallback = None
            if store == "dask":  # (the run's own mooncake_master stopped with the run)
                # an engine that no longer holds the version before: the delta cannot apply, it pulls the full version
                await client.run(_forget_the_base, workers=list(p.pool_of))
                s.weights.publish(run.published + 1, p.pool_of)
                fallback = await s.weights.wait_staged()
            return result, trainer, engines, fallback, dict(s.weights.counts)
        finally:
            await close(run, client, cluster)

    result, trainer, engines, fallback, counts = run_async(go(), timeout=400)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    pulls = {r["weights"]["version"]: r["weights"] for r in rows if r.get("kind") == "step" and "weights" in r}
    assert sorted(pulls) == [1, 2, 3, 4] and pulls[1]["engines_delta"] == 0  # v1: the first this trainer published, full
    for v in (2, 3, 4):  # then each version as its change from the last, on every engine, smaller than the version
        w = pulls[v]
        assert w["engines_delta"] == w["engines"] >= 1 and 0 < w["delta_bytes"] < 0.8 * w["bytes"], w
        assert w["bytes_moved"] == w["delta_bytes"] * w["engines"], w
    assert result["last"]["version"] == 5 and set(engines.values()) == {trainer}  # rebuilt bit for bit at the last version
    assert result["weights"]["delta_pulls"] == 4 / 5 and result["weights"]["delta_bytes"] < result["weights"]["bytes"]  # v2–v5
    if fallback is not None:
        assert counts["weights_delta_fallbacks"] == len(engines) and fallback["engines_delta"] == 0  # tried, then pulled in full
        assert fallback["bytes_moved"] == fallback["bytes"] * len(engines)


def _nudge_the_trainer(seed: int):  # (a task on the trainer's worker) an optimizer-sized step on every weight, seeded
    import torch

    from rollart_dask.data import plugins, tasks

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tasks.service(plugins.TRAINER).model.parameters():
            p.add_(1e-3 * torch.sign(torch.randn(p.shape, generator=g)))


def test_fifty_versions_by_delta_are_bit_equal_to_the_same_versions_pulled_in_full(address, tmp_path, model_dir, run_async):
    """Two engines take each of 50 versions, one by its delta, the other in full (it forgets the version it held
    before each): at every version both hold the trainer's weights bit for bit."""
    from rollart_dask.data import plugins

    data = flow_dict(**{"cluster.scheduler": address, "weights.delta": True, "weights.bucket_mb": 0.05})
    data["tasks"][0]["affinity"] = "any"  # both engines, H800 and H20
    cfg = load_flow(data=data)

    async def go():
        run, client, cluster = await start_run(cfg, tmp_path, model_dir)
        try:
            s, p = run.services, run.services.proxy
            by_delta, in_full = sorted(p.pool_of)[:2]
            probe = lambda name, pool, at: run.d.submit_one("probe", _weights_digest, name, pool=pool, worker=at)  # noqa: E731
            rows, differ = [], []
            for v in range(run.published + 1, run.published + 51):
                await run.d.submit_one("nudge", _nudge_the_trainer, v, pool="TRAIN", worker=s.trainer)
                await client.run(_forget_the_base, workers=[in_full])
                s.weights.publish(v, p.pool_of)
                rows.append(await s.weights.wait_staged())
                await p.update_weights(v)
                digests = [await probe(plugins.TRAINER, "TRAIN", s.trainer)]
                digests += [await probe(plugins.ENGINE, p.pool_of[a], a) for a in (by_delta, in_full)]
                if len(set(digests)) != 1:
                    differ.append(v)
            return rows, differ, dict(s.weights.counts)
        finally:
            await close(run, client, cluster)

    rows, differ, counts = run_async(go(), timeout=400)
    assert len(rows) == 50 and differ == []  # trainer, delta engine and full engine: one set of weights at every version
    assert [r["engines_delta"] for r in rows[1:]] == [1] * 49 and rows[0]["engines_delta"] == 0  # (the first: no version before)
    assert counts["weights_delta_fallbacks"] == 49  # the other engine tried each delta, then pulled the version in full
    assert all(r["bytes_moved"] == r["bytes"] + r["delta_bytes"] for r in rows[1:])
