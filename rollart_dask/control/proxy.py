"""LLMProxy: routes generation by affinity and load, sticky per trajectory; suspend/resume;
cooperative abort (Dask cannot stop a running task, so the engine's own abort is used)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict

from dataclasses import dataclass, field, replace
from typing import Callable

from rollart_dask.control.dispatch import Dispatcher
from rollart_dask.control.phases import task_key
from rollart_dask.control.timeouts import FLOOR_S, GenerateTimeouts
from rollart_dask.data import tasks
from rollart_dask.resource.pools import ENGINE_POOLS, submit_kwargs
from rollart_dask.types import Completion


class TrajectoryCancelled(Exception):
    """The trajectory was aborted (stale, redundant, or its group dropped)."""


class LLMProxy:
    def __init__(
        self,
        dispatcher: Dispatcher,
        engines: dict[str, list[str]],
        timeout_s: float | str = 120,
        streamed: bool = False,
        pd=None,
        partial: str = "restart",
        wait_s: float = 120,
    ):
        self.d = dispatcher
        self.wait_s = wait_s  # how long a call waits for an engine of its pool when there is none (lost, a replacement coming)
        self._joined = asyncio.Event()  # an engine began serving
        self.on_engine_error = None  # async (address, error) -> True when that engine is gone (then handled: control/elastic.py)
        self.partial = partial  # rollout.partial: a turn Suspend interrupted restarts, or continues from its prefix
        self.pd = pd  # rollout.pd (prefill, decode pools): each call is prefilled on one pool and decoded on the other (PDRoute below)
        self._peer: dict[str, str] = {}  # request id → its prefill engine, when disaggregated (aborts go to both engines)
        self.streamed = streamed  # engines that batch continuously across calls answer each request on its own
        self.engines = {p: list(a) for p, a in engines.items() if a}  # pool → the engines serving it (routing)
        self.pool_of = {a: p for p, addrs in self.engines.items() for a in addrs}  # every engine weight updates go to
        self.generate_timeouts = GenerateTimeouts(timeout_s)  # per generate call: fixed, or from the engine's measured speed (auto)
        self.timeout_s = FLOOR_S if timeout_s == "auto" else float(timeout_s)  # control calls (weights, aborts, Suspend's wait)
        self.timed_out = 0  # generate calls that ran past their timeout
        self.load: Counter = Counter()
        self.sticky: dict[str, str] = {}
        self.version = 0  # the engines' policy version
        self.cancelled: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._inflight: dict[str, tuple[str, str]] = {}  # request id → (engine, trajectory id)
        self._idle = asyncio.Event()
        self._idle.set()
        self.requests = 0
        self.landed: Counter = Counter()  # (task, engine pool) → generate calls: where each task's generation went
        self.reissued = 0
        self.tokens = Counter()  # generated (every token an engine returned), discarded (restarted partials), continued
        self._rids = itertools.count()  # request ids: trajectory#n, unique within this proxy

    def landed_by_task(self) -> dict[str, dict[str, int]]:
        """Generate calls per task and engine pool (the decode pool's, when prefill/decode are disaggregated)."""
        out: dict[str, dict[str, int]] = {}
        for (task, pool), n in sorted(self.landed.items()):
            out.setdefault(task, {})[pool] = n
        return out

    @property
    def suspended(self) -> bool:
        return not self._open.is_set()

    def pick(self, traj_id: str, pool: str | None) -> str:
        addr = self.sticky.get(traj_id)  # (a task placed anew since — affinity auto — leaves its old pool's engine)
        if addr in self.pool_of and addr in self.engines.get(self.pool_of[addr], ()) and pool in (None, self.pool_of[addr]):
            return addr
        pools = [pool] if pool else list(ENGINE_POOLS)
        candidates = [a for p in pools for a in self.engines.get(p, [])]
        if not candidates:
            raise RuntimeError(f"no engine for pool {pool or 'any'}; engines: {self.engines}")
        addr = min(candidates, key=lambda a: self.load[a])
        self.sticky[traj_id] = addr
        return addr

    async def generate(
        self,
        traj_id: str,
        pool: str | None | Callable[[], str | None],
        prompt: str,
        choices: list[str] | None,
        max_tokens: int,
        temperature: float,
        emulate: dict | None = None,
        counted: bool = True,
        task: str = "",
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> Completion:
        """``emulate``: an EMULATED workload's lengths for this turn (only the emulated engine reads it). ``counted``: its
        tokens go into ``tokens`` (False for evaluation, which is never trained). ``task``: whose call (``landed``). ``pool``
        may be a callable, asked each time the call is (re-)issued: a turn aborted by Suspend goes where its task is placed
        by then (affinity auto). ``prompt``: an observation (one user message) or the chat messages; ``stop``: stop strings;
        ``seed``: the turn's sampling seed (rollout.deterministic: each token drawn from its own generator, algo/seeding.py)."""
        tokens = self.tokens if counted else Counter()
        prefix = Prefix()  # rollout.partial=continue: the response so far, across the versions that made it
        placed = pool if callable(pool) else (lambda fixed=pool: fixed)
        while True:
            await self._open.wait()
            if traj_id in self.cancelled:
                raise TrajectoryCancelled(traj_id)
            pool = placed()
            if not self.pd:
                await self._engine_of(pool)
            route = pd_route(self, traj_id) if self.pd else None  # sticky engines in both pools; decode is the call's worker
            addr = route.decode_worker if route else self.pick(traj_id, pool)
            rid = f"{traj_id}#{next(self._rids)}"
            item = {"id": rid, "prompt": prompt, "choices": choices, "max_tokens": max_tokens - len(prefix.ids), "temperature": temperature}
            if prefix.ids:
                item["prefix_ids"] = prefix.ids
            if emulate:
                item["emulate"] = emulate
            if stop:
                item["stop"] = list(stop)
            if seed is not None:
                item["seed"] = seed
            self._inflight[rid] = (addr, traj_id)
            self._idle.clear()
            self.load[addr] += 1
            if route:
                self._peer[rid] = route.prefill_worker
                self.load[route.prefill_worker] += 1
            self.requests += 1
            self.landed[task, self.pool_of[addr]] += 1
            budget = self.generate_timeouts
            started = budget.clock()
            budget.start(addr, item["max_tokens"])
            c = None
            try:
                fn = route or (tasks.generate_stream if self.streamed else tasks.generate_batch)
                call = asyncio.ensure_future(
                    self.d.call("generate", fn, item, pool=self.pool_of[addr], worker=addr, timeout=budget.fixed, streamed=self.streamed)
                )
                c = await budget.wait(call, addr, started)
            except TimeoutError:
                self.timed_out += 1
                await self._abort({rid: addr})
                raise
            finally:
                budget.done(addr, item["max_tokens"], len(c.token_ids) if c is not None else 0, answered=c is not None)
                self._inflight.pop(rid, None)
                self.load[addr] -= 1
                if route:
                    self.load[self._peer.pop(rid)] -= 1
                if not self._inflight:
                    self._idle.set()
            tokens["generated"] += len(c.token_ids)
            if c.finish_reason != "abort":
                return prefix.join(c)
            if traj_id in self.cancelled:
                raise TrajectoryCancelled(traj_id)
            self.reissued += 1  # aborted by Suspend: re-issued after Resume, under the new weights
            if self.partial == "continue":  # from its prefix (re-prefilled with it)
                prefix.add(c)
                tokens["continued"] += len(c.token_ids)
                if len(prefix.ids) >= max_tokens:  # aborted on its last token: nothing left to generate
                    return prefix.join(replace(c, token_ids=[], logprobs=[], allowed_ids=None, finish_reason="length"))
            else:  # from the turn's prompt: what it generated is discarded
                tokens["discarded"] += len(c.token_ids)

    async def _engine_of(self, pool: str | None) -> None:
        """Return once an engine serves ``pool`` (any, when None); wait up to ``wait_s`` while none does."""
        pools = [pool] if pool else list(ENGINE_POOLS)
        deadline = None
        while not any(self.engines.get(p) for p in pools):
            deadline = deadline or asyncio.get_running_loop().time() + self.wait_s
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise RuntimeError(
                    f"no engine for pool {pool or 'any'} for rollout.worker_wait_s={self.wait_s:.0f} s; engines: {self.engines}"
                )
            self._joined.clear()
            try:
                await asyncio.wait_for(self._joined.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- engines that leave and join (control/elastic.py) ------------------------------------------
    def engine_lost(self, address: str) -> bool:
        """Stop routing to a departed engine (its calls fail over through the dispatcher); False if it was none."""
        pool = self.pool_of.pop(address, None)
        if pool is None:
            return False
        if address in self.engines.get(pool, ()):
            self.engines[pool].remove(address)
        self.sticky = {t: a for t, a in self.sticky.items() if a != address}
        return True

    def engine_joining(self, address: str, pool: str) -> None:
        """A joined engine being brought to the engines' version: weight operations include it, calls do not yet."""
        self.pool_of[address] = pool

    def engine_serving(self, address: str, pool: str) -> None:
        """A joined engine, at the engines' version now: calls may go to it."""
        self.pool_of[address] = pool
        if address not in self.engines.setdefault(pool, []):
            self.engines[pool].append(address)
        self._joined.set()

    async def swap_one(self, address: str, pool: str, version: int) -> None:
        """Swap ``version`` (staged there) into one engine that is not serving yet."""
        from rollart_dask.data.weights.worker import engine_swap_batch

        await self.d.call("update-weights", engine_swap_batch, {"version": version}, pool=pool, worker=address, timeout=self.timeout_s)

    def forget(self, traj_id: str) -> None:
        self.sticky.pop(traj_id, None)
        self.sticky.pop(prefill_key(traj_id), None)
        self.cancelled.discard(traj_id)

    async def cancel(self, traj_ids: list[str]) -> None:
        """Abort the engine requests of these trajectories (their coroutines are cancelled by the caller)."""
        ids = set(traj_ids) & {t for _, t in self._inflight.values()}
        self.cancelled |= ids
        await self._abort({rid: addr for rid, (addr, t) in self._inflight.items() if t in ids})

    async def _abort(self, rids: dict[str, str]) -> None:
        by_engine = defaultdict(list)
        for rid, addr in rids.items():
            by_engine[addr].append(rid)
            if rid in self._peer:  # disaggregated: the request may still be in its prefill
                by_engine[self._peer[rid]].append(rid)
        await self._on_engines("abort", tasks.engine_abort_stream, {a: {"ids": ids} for a, ids in by_engine.items()}, streamed=True)

    async def _on_engines(self, stage: str, fn, items: dict[str, dict], streamed: bool = False) -> None:
        """A control call on each of these engines (address → its item), over the dispatcher's channels: in order
        with the generate batches sent before it, and no scheduler between (a Dask task each cost the step protocol
        a scheduler round trip per call)."""
        items = {a: item for a, item in items.items() if a in self.pool_of}
        results = await asyncio.gather(
            *(
                self.d.call(stage, fn, item, pool=self.pool_of[a], worker=a, timeout=self.timeout_s, streamed=streamed)
                for a, item in items.items()
            ),
            return_exceptions=True,
        )
        for a, r in zip(items, results):
            if isinstance(r, BaseException) and a in self.pool_of:  # (an engine lost meanwhile has nothing to do any more)
                if isinstance(r, Exception) and self.on_engine_error is not None and await self.on_engine_error(a, r):
                    continue
                raise r

    # -- the protocol's Suspend / Update / Resume / Recompute KV ---------------------------------
    async def suspend(self) -> None:
        self._open.clear()
        await self._abort({rid: addr for rid, (addr, _) in self._inflight.items()})
        await asyncio.wait_for(self._idle.wait(), self.timeout_s)

    def resume(self) -> None:
        self._open.set()

    async def update_weights(self, version: int) -> None:
        """Swap in ``version``, already staged on every engine (weights/store.py)."""
        from rollart_dask.data.weights.worker import engine_swap_batch

        await self._on_engines("update-weights", engine_swap_batch, {a: {"version": version} for a in self.pool_of})
        self.version = version

    async def reset_prefix_cache(self) -> None:
        await self._on_engines("reset-prefix-cache", tasks.engine_reset_prefix_cache_batch, {a: {} for a in self.pool_of})


@dataclass
class Prefix:
    """A turn's response generated so far across interruptions (rollout.partial=continue): the tokens, their behaviour
    log-probs, allowed ids and the version that made each; the prompt is the first request's."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    allowed: list | None = None
    versions: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None

    def add(self, c: Completion) -> None:
        if not c.token_ids:  # aborted before its first token (or by an engine that returns no partial response)
            return
        if self.prompt_ids is None:
            self.prompt_ids = list(c.prompt_ids)
        n = len(c.token_ids)
        self.ids += list(c.token_ids)
        self.logprobs += list(c.logprobs)[:n]
        if c.allowed_ids is not None:
            self.allowed = (self.allowed or []) + list(c.allowed_ids)[:n]
        self.versions += [c.version] * n

    def join(self, c: Completion) -> Completion:
        """The whole turn: this prefix, then ``c`` (the last request's continuation; its text is the whole response's)."""
        if self.prompt_ids is None:
            return c
        allowed = None if self.allowed is None and c.allowed_ids is None else (self.allowed or []) + list(c.allowed_ids or [])
        return replace(
            c,
            prompt_ids=self.prompt_ids,
            token_ids=self.ids + list(c.token_ids),
            logprobs=self.logprobs + list(c.logprobs),
            allowed_ids=allowed,
            token_versions=self.versions + [c.version] * len(c.token_ids),
        )


# -- prefill/decode disaggregation (rollout.pd): a call's route through two engines ------------------------
@dataclass(frozen=True)
class PDRoute:
    """A disaggregated generate call's route, used by the dispatcher in place of a task function:
    calls with the same route that arrive together share one prefill task and one decode task."""

    prefill_worker: str
    prefill_pool: str
    decode_worker: str
    decode_pool: str

    def submit(self, client, args: tuple, streamed: bool):
        """Submit the prefill task and the decode task that takes its future; returns the decode future.
        ``args``: (items, topic) — the decode worker answers on the dispatcher's channel."""
        items, topic = args
        pf = client.submit(tasks.prefill_batch, items, **submit_kwargs(self.prefill_pool, self.prefill_worker, key=task_key("pd-prefill")))
        decode = tasks.decode_stream if streamed else tasks.decode_batch
        return client.submit(decode, pf, items, topic, **submit_kwargs(self.decode_pool, self.decode_worker, key=task_key("pd-decode")))


def prefill_key(traj_id: str) -> str:
    return f"{traj_id}@prefill"


def pd_route(proxy, traj_id: str) -> PDRoute:
    """The proxy's route for a disaggregated call: an engine of each pool, least loaded and sticky per
    trajectory (a trajectory's turns prefill where its earlier prompts were prefilled)."""
    pd = proxy.pd
    prefill = proxy.pick(prefill_key(traj_id), pd.prefill)
    decode = proxy.pick(traj_id, pd.decode)
    return PDRoute(prefill, pd.prefill, decode, pd.decode)
