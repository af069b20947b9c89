"""The thin task functions the control plane submits: each finds its service in the worker
(``service(name)``, held by a plugin in data/plugins.py) and calls it.

Batch functions take a list of items and answer per item ("ok", value) or ("err", message): one bad
item never fails its neighbours. Pinned calls arrive over the caller's channel (data/channels.py) and
take it as ``reply``: they answer on it instead of in a result (a Dask task of the prefill/decode route
names it by its topic); streamed ones start their items and answer each as soon as it is done.
"""

from __future__ import annotations

import pickle
import threading
import time

from distributed import get_worker

from rollart_dask.data.channels import Channel, channels, failure, here
from rollart_dask.data.plugins import ENGINE, ENVHOST, REWARD, TRAINER


def service(name: str, worker=None):
    worker = worker or here.get(None) or get_worker()
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


def run_batch(fn, payload: bytes, *args):
    """The task of every coalesced call: ``fn(items, *args)`` with the items as the control plane pickled them.
    As one bytes object the scheduler passes them on instead of unpickling and re-pickling every request, and
    the client's Dask does not walk each request looking for keys. The task's key names its stage."""
    return fn(pickle.loads(payload), *args)


def _channel(reply: Channel | str) -> Channel:
    """The caller's channel: given (a call that came over it), or named by its topic (a Dask task), which
    fails the task at once where the caller has none rather than answer into nothing."""
    return reply if isinstance(reply, Channel) else channels(get_worker()).get(reply)


def _reply(items: list[dict], answers: list, reply: Channel | str | None):
    """The answers as the task's result (calls to a pool), or on the caller's channel (pinned calls)."""
    if reply is None:
        return answers
    _channel(reply).post_many([(item["_cid"], a) for item, a in zip(items, answers)])
    return len(answers)


# -- thin tasks ----------------------------------------------------------------------------
def generate_batch(items: list[dict], reply=None):
    try:
        answers = [("ok", c) for c in service(ENGINE).generate(items)]
    except Exception as e:
        answers = [failure(e)] * len(items)
    return _reply(items, answers, reply)


def reward_batch(items: list[dict], reply=None):
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
    return _reply(items, out, reply)


# -- streamed tasks: start the items, answer each on the caller's channel as soon as it is done ---------
INLINE_S = 0.002  # a streamed batch runs its items in its own thread while they take less than this, together


class Speed:
    """How long one kind of item takes. Items of a kind that has been fast run in the batch's own thread (the worker's
    event loop), one after the other, for at most INLINE_S per batch: a hand-off to another thread costs more than
    they do. The others go to the service's pool. An item that turns out slow holds back the rest of its batch by its
    own time, once: it pushes its kind's time up, and the next batches hand it off.

    Times taken in the pool include the waits for the GIL of many busy threads, so a fast kind timed only there looks
    slow and would stay in the pool: a kind that looks no slower than PROBE_CEIL_S runs alone now and then (one item
    in PROBE_EVERY) to be timed alone, and its time alone is what decides."""

    PROBE_CEIL_S = 0.002
    PROBE_EVERY = 16

    def __init__(self, fast_s: float = 0.0005):
        self.fast_s, self.mean_s, self.alone_s, self._n = fast_s, None, None, 0

    def add(self, seconds: float, alone: bool = False) -> None:
        self.mean_s = seconds if self.mean_s is None else 0.9 * self.mean_s + 0.1 * seconds
        if alone:
            self.alone_s = seconds if self.alone_s is None else 0.9 * self.alone_s + 0.1 * seconds

    @property
    def fast(self) -> bool:
        seconds = self.alone_s if self.alone_s is not None else self.mean_s
        return seconds is not None and seconds < self.fast_s

    def probe(self) -> bool:
        """Whether this item of a kind that looks slow (but not very) should run alone, to be timed."""
        if self.fast_s <= 0 or self.mean_s is None or self.mean_s >= self.PROBE_CEIL_S:
            return False
        self._n += 1
        return self._n % self.PROBE_EVERY == 0


_speeds: dict[tuple, Speed] = {}  # (service, method, kind) → its Speed, per worker process


def speed(*key) -> Speed:
    s = _speeds.get(key)
    if s is None:
        s = _speeds[key] = Speed()
    return s


def _start(fn, items: list[dict], reply, executor, speed_of) -> int:
    """Start ``fn`` on each item and answer each on the caller's channel when it is done; ``speed_of(item)``: its kind's Speed.
    Fast items run here, INLINE_S at a time, and those beyond that in later turns of the worker's event loop, INLINE_S
    each, with the loop's other work between — not in the pool, where hundreds of tiny items would cost a hand-off
    each and wait for the GIL among its threads."""
    ch = _channel(reply)
    if items:
        ch.post(("free", items[0]["_cid"]), None)  # the caller may send its next batch to this service now

    def one(item, pace: Speed, alone: bool):
        t0 = time.perf_counter()
        try:
            result = ("ok", fn(item))
        except Exception as e:  # reported per item; the control plane decides retry/fail
            result = failure(e)
        pace.add(time.perf_counter() - t0, alone)
        ch.post(item["_cid"], result)

    def inline(fast: list) -> None:
        t_end = time.perf_counter() + INLINE_S
        for i, (item, pace, probe) in enumerate(fast):
            if not (probe or pace.fast):  # its kind turned out slow meanwhile: the rest of it goes to the pool
                executor.submit(one, item, pace, False)
            elif time.perf_counter() >= t_end:
                ch.worker.loop.add_callback(inline, fast[i:])
                return
            else:
                one(item, pace, True)

    fast = []
    for item in items:
        pace = speed_of(item)
        if pace.fast:
            fast.append((item, pace, False))
        elif pace.probe():
            fast.append((item, pace, True))
        else:
            executor.submit(one, item, pace, False)
    if fast:
        inline(fast)
    return len(items)


def env_reset_stream(items: list[dict], reply) -> int:
    host = service(ENVHOST)
    return _start(
        host.reset, items, reply, host.pool, lambda item: _NEVER_INLINE if item.get("inject") else speed(ENVHOST, "reset", item["env"])
    )


def env_step_stream(items: list[dict], reply) -> int:
    host = service(ENVHOST)
    return _start(host.step, items, reply, host.pool, lambda item: _step_speed(host.kind(item["traj_id"])))


def _step_speed(kind: str) -> "Speed":
    # EMULATED envs sleep and hang on purpose: on the worker's event loop a hang would stall every call of the worker
    # (and its heartbeats) for its whole length, so they always take a thread of the pool
    return _NEVER_INLINE if kind == "Injected" else speed(ENVHOST, "step", kind)


def generate_stream(items: list[dict], reply) -> int:
    """For engines that batch continuously across calls (emulated, null): each request joins the running
    batch at once and is answered when it finishes, not when its call's slowest does. Inline only where a
    request's time is its own (``answers_alone``): one that waits for its batch says nothing about what a
    hand-off costs."""
    engine = service(ENGINE)
    pace = speed(ENGINE, "generate") if getattr(engine, "answers_alone", False) else _NEVER_INLINE
    return _start(lambda item: engine.generate([item])[0], items, reply, engine.pool, lambda item: pace)


_NEVER_INLINE = Speed(fast_s=0.0)


# -- the engines' control calls (the step protocol's abort, reset of the prefix cache; the swap is in weights/worker.py) --
def engine_abort_stream(items: list[dict], reply) -> int:
    """Abort the requests named by each item's ``ids``, on the worker's event loop: never behind a busy thread, and
    after every generate batch this caller sent before it (one comm, in order)."""
    ch = _channel(reply)
    ch.post(("free", items[0]["_cid"]), None)
    engine = service(ENGINE)
    return _reply(items, _per_item(lambda item: engine.abort(item["ids"]), items), ch)


def engine_reset_prefix_cache_batch(items: list[dict], reply=None):
    engine = service(ENGINE)
    return _reply(items, _per_item(lambda item: engine.reset_prefix_cache(), items), reply)


# One trainer call at a time in this process, and the last Train's answer: a Train submitted again (the client lost
# the scheduler and, with it, the first one's future) while or after the first one ran trains nothing twice.
_trainer_lock = threading.Lock()
_last_train: dict = {}


def trainer_step(samples: list[dict], _after=None, batch_id: str | None = None, max_lag: int | None = None) -> dict:
    """One update. ``max_lag`` (rollout.max_trained_lag): a sample with a token more versions behind this trainer than
    that is not trained, whatever the client's bookkeeping said (its Get Batch evicts them first: this is the bound's
    last guard, at the version the trainer actually stands at)."""
    from rollart_dask.algo.samples import version_lag, within_lag

    trainer = service(TRAINER)
    with _trainer_lock:
        if batch_id is not None and _last_train.get("batch_id") == batch_id:
            return dict(_last_train["result"])
        dropped = 0
        if max_lag is not None:
            samples, dropped = within_lag(samples, trainer.version, max_lag)
            if not samples:
                raise RuntimeError(
                    f"every sample of the batch is more than rollout.max_trained_lag={max_lag} versions behind the trainer (v{trainer.version})"
                )
        lag = version_lag(samples, trainer.version)  # per-token versions: how off-policy the batch is, token by token
        result = {**trainer.train_step(samples), **lag, "samples_over_lag_dropped": dropped}
        _last_train.update(batch_id=batch_id, result=dict(result))
        return result


def trainer_settled() -> int:
    """The trainer's version once no trainer call runs (the client cannot tell whether a Train whose future it lost ran)."""
    with _trainer_lock:
        return service(TRAINER).version


def trainer_warm_start(demos: list[dict], steps: int, batch: int, lr: float, seed: int, shares: dict | None) -> dict:
    return service(TRAINER).warm_start(demos, steps, batch, lr, seed, shares)


def env_preflight(item: dict) -> dict:
    """The episode, or {"user_error": message}: the user's fault is an answer, not a failed task (which every worker
    would log as "Compute Failed" with a traceback before the pre-flight's own clear report)."""
    from rollart_dask.data.envhost import preflight_episode
    from rollart_dask.usercode import UserFunctionError

    try:
        return preflight_episode(item)
    except UserFunctionError as e:
        return {"user_error": str(e)}


def env_expert_demos(item: dict) -> list[dict]:
    from rollart_dask.data.envhost import expert_demos

    return expert_demos(item)


def trainer_checkpoint(path: str, _after=None) -> str:
    """Written beside ``path`` and renamed into place once whole: a write that fails (a full disk) leaves no
    checkpoint that looks complete, and none of its partial files."""
    from pathlib import Path

    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    with _trainer_lock:  # (two writes of one step, the second submitted after the client lost the first's future)
        return _write_checkpoint(final, partial)


def _write_checkpoint(final, partial) -> str:
    import os
    import shutil

    shutil.rmtree(partial, ignore_errors=True)
    try:
        service(TRAINER).save_checkpoint(partial)
        shutil.rmtree(final, ignore_errors=True)  # (a resumed run writes a step's checkpoint again)
        os.replace(partial, final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(final)


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


def env_close_batch(items: list[dict], reply=None):
    """Together, on the host's threads: a close that waits out a hung call must not hold back the others."""
    host = service(ENVHOST)
    close = lambda item: host.close(item["traj_id"], item.get("hung_after_s", 5.0))  # noqa: E731
    return _reply(items, _per_item(close, items, map_=host.pool.map), reply)


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


def decode_batch(prefilled: list, items: list[dict], topic: str | None = None):
    """Decode task (engine of the decode pool). ``prefilled`` is the prefill task's result: Dask
    brings it — KV caches included — from the prefill worker to this one before the task runs."""
    return _reply(items, _decode_items(service(ENGINE), prefilled), topic)


def decode_stream(prefilled: list, items: list[dict], topic: str) -> int:
    """Streamed decode (engines that batch continuously across calls): each request is answered on
    the caller's channel as soon as it is done (see generate_stream)."""
    engine = service(ENGINE)
    ch = _channel(topic)
    if items:
        ch.post(("free", items[0]["_cid"]), None)

    def one(pair):
        item, result = pair
        ch.post(item["_cid"], _decode_items(engine, [result])[0])

    for pair in zip(items, prefilled):
        engine.pool.submit(one, pair)
    return len(items)
