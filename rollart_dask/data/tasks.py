"""The thin task functions the control plane submits: each finds its service in the worker
(``service(name)``, held by a plugin in data/plugins.py) and calls it.

Batch tasks take a list of items and answer per item ("ok", value) or ("err", message): one bad
item never fails its neighbours. Streamed tasks start their items and answer each on the caller's
topic as soon as it is done.
"""
from __future__ import annotations

import pickle
import threading

from distributed import get_worker

from rollart_dask.data.plugins import ENGINE, ENVHOST, REWARD, TRAINER


def failure(e: BaseException) -> tuple[str, str]:
    """A per-item error answer: the control plane decides retry or fail from it."""
    return ("err", f"{type(e).__name__}: {e}")


def service(name: str, worker=None):
    worker = worker or get_worker()
    plugin = worker.plugins.get(name)
    if plugin is None or plugin.service is None:
        raise RuntimeError(f"no {name} service on worker {worker.name} (resources {dict(worker.state.total_resources)})")
    return plugin.service


def _per_item(fn, items: list, map_=map) -> list:
    def one(item):
        try:
            return ("ok", fn(item))
        except Exception as e:  # reported per item; the control plane decides retry/fail
            return failure(e)

    return list(map_(one, items))


# -- thin tasks ----------------------------------------------------------------------------
def generate_batch(items: list[dict]) -> list:
    try:
        return [("ok", c) for c in service(ENGINE).generate(items)]
    except Exception as e:
        return [failure(e)] * len(items)


def reward_batch(items: list[dict]) -> list:
    """Plain rewards per item (concurrent Lambda invocations when serverless); stateful ones (a
    judge: the control plane sends them to the REWARD pool) as one batched generation."""
    runner = service(REWARD)
    out: list = [None] * len(items)
    stateful = [runner.is_stateful(item["reward"]) for item in items]
    judged = [i for i, s in enumerate(stateful) if s]
    plain = [i for i, s in enumerate(stateful) if not s]
    for i, r in zip(plain, _per_item(runner.score, [items[i] for i in plain], runner.map)):
        out[i] = r
    for i, r in zip(judged, runner.score_stateful([items[i] for i in judged]) if judged else []):
        out[i] = r
    return out


# -- streamed tasks: start the items, answer each on the caller's topic as soon as it is done ---------
_outbox: dict[tuple, list] = {}  # (worker address, topic) → answers not yet sent
_outbox_lock = threading.Lock()


def _answer(worker, topic: str, item: dict, result: tuple) -> None:
    """Queue one answer; answers finished by the same event-loop tick leave as one event (one scheduler
    message for many calls, not one each). Pickled: events must be msgpack."""
    key = (worker.address, topic)
    with _outbox_lock:
        pending = _outbox.setdefault(key, [])
        pending.append((item["_cid"], pickle.dumps(result)))
        first = len(pending) == 1
    if first:
        worker.loop.add_callback(_flush, worker, key)  # thread-safe; runs on the worker's event loop


def _flush(worker, key: tuple) -> None:
    with _outbox_lock:
        answers = _outbox.pop(key, [])
    if answers:
        worker.log_event(key[1], answers)


def _start(fn, items: list[dict], topic: str, executor) -> int:
    worker = get_worker()

    def one(item):
        try:
            result = ("ok", fn(item))
        except Exception as e:  # reported per item; the control plane decides retry/fail
            result = failure(e)
        _answer(worker, topic, item, result)

    for item in items:
        executor.submit(one, item)
    return len(items)


def env_reset_stream(items: list[dict], topic: str) -> int:
    host = service(ENVHOST)
    return _start(host.reset, items, topic, host.pool)


def env_step_stream(items: list[dict], topic: str) -> int:
    host = service(ENVHOST)
    return _start(host.step, items, topic, host.pool)


def generate_stream(items: list[dict], topic: str) -> int:
    """For engines that batch continuously across calls (the emulated one): each request joins the
    running batch at once and is answered when it finishes, not when its call's slowest does."""
    engine = service(ENGINE)
    return _start(lambda item: engine.generate([item])[0], items, topic, engine.pool)


async def engine_abort(request_ids: list[str]) -> int:
    return service(ENGINE).abort(request_ids)  # on the event loop: never waits for a free thread


def engine_reset_prefix_cache() -> int:
    return service(ENGINE).reset_prefix_cache()


def trainer_step(samples: list[dict], _after=None) -> dict:
    return service(TRAINER).train_step(samples)


def trainer_warm_start(demos: list[dict], steps: int, batch: int, lr: float, seed: int, shares: dict | None) -> dict:
    return service(TRAINER).warm_start(demos, steps, batch, lr, seed, shares)


def env_expert_demos(item: dict) -> list[dict]:
    from rollart_dask.data.envhost import expert_demos

    return expert_demos(item)


def trainer_checkpoint(path: str, _after=None) -> str:
    return service(TRAINER).save_checkpoint(path)


def trainer_restore(path: str) -> int:
    return service(TRAINER).restore(path)


def service_stats(dask_worker=None) -> dict:
    """Per-service counters of this worker (called through client.run)."""
    out = {}
    for name in (ENGINE, ENVHOST, REWARD):
        plugin = dask_worker.plugins.get(name)
        if plugin is not None and plugin.service is not None:
            out[name] = dict(plugin.service.stats)
    return out


def env_close_batch(items: list[dict]) -> list:
    return _per_item(lambda item: service(ENVHOST).close(item["traj_id"]), items)


# -- prefill/decode disaggregation (rollout.pd): the two tasks of a disaggregated generate call ------------
def prefill_batch(items: list[dict]) -> list:
    """Prefill task (engine of the prefill pool): per item ("ok", PrefillHandle) or ("err", message)."""
    try:
        return [("ok", h) for h in service(ENGINE).prefill(items)]
    except Exception as e:
        return [failure(e)] * len(items)


def _decode_items(engine, prefilled: list) -> list:
    handles = [value for status, value in prefilled if status == "ok"]
    try:
        done = iter(engine.decode_from_prefill(handles) if handles else [])
        return [("ok", next(done)) if status == "ok" else (status, value) for status, value in prefilled]
    except Exception as e:
        return [failure(e) if status == "ok" else (status, value) for status, value in prefilled]


def decode_batch(prefilled: list) -> list:
    """Decode task (engine of the decode pool). ``prefilled`` is the prefill task's result: Dask
    brings it — KV caches included — from the prefill worker to this one before the task runs."""
    return _decode_items(service(ENGINE), prefilled)


def decode_stream(prefilled: list, items: list[dict], topic: str) -> int:
    """Streamed decode (engines that batch continuously across calls): each request is answered on
    ``topic`` as soon as it is done (see generate_stream)."""
    engine, worker = service(ENGINE), get_worker()

    def one(pair):
        item, result = pair
        _answer(worker, topic, item, _decode_items(engine, [result])[0])

    for pair in zip(items, prefilled):
        engine.pool.submit(one, pair)
    return len(items)
