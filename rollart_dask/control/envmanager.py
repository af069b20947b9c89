"""EnvManager: one coroutine per trajectory — reset → [generate → step]* → reward — with its
own timeouts and retry budget. Envs are placed on the least-loaded env worker and every
step goes where the env lives; a lost env worker fails the trajectory with WorkerLost so the
buffer relaunches it elsewhere (counted)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from rollart_dask.algo.seeding import mixed_seed
from rollart_dask.config import EngineConfig, RolloutConfig, TaskConfig, task_pool
from rollart_dask.control.breaker import as_user_fault
from rollart_dask.control.dispatch import CallFailed, Dispatcher, WorkerLost
from rollart_dask.control.proxy import LLMProxy
from rollart_dask.models.prompts import Conversation
from rollart_dask.data import tasks
from rollart_dask.types import Trajectory, Turn


class TurnBarrier:
    """Batch-level env interaction: every live trajectory of a wave waits for the others before
    each generate (the veRL-style baseline). A finished trajectory leaves the barrier."""

    def __init__(self, parties: int):
        self.parties, self.arrived = parties, 0
        self._event = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        event = self._event
        if self.arrived >= self.parties:
            self._release()
        else:
            await event.wait()

    def leave(self) -> None:
        self.parties -= 1
        if self.parties > 0 and self.arrived >= self.parties:
            self._release()

    def _release(self) -> None:
        self.arrived = 0
        event, self._event = self._event, asyncio.Event()
        event.set()


class EnvManager:
    def __init__(
        self,
        dispatcher: Dispatcher,
        proxy: LLMProxy,
        env_workers: list[str],
        rollout: RolloutConfig,
        engine: EngineConfig,
        reward_pool: str = "REWARD",
        reward_functions: dict[str, str] | None = None,
        stateful_rewards=(),
        reward_workers: dict[str, list[str]] | None = None,
    ):
        self.d, self.proxy, self.rollout, self.engine = dispatcher, proxy, rollout, engine
        self.reward_pool = reward_pool
        # pool → its reward workers: a reward call is pinned to one (answered on the dispatcher's channel, like every
        # other call) and retried on another when its worker is lost; without them it goes to the pool
        self.reward_workers = {p: list(a) for p, a in (reward_workers or {}).items()}
        self._reward_turn = 0
        self.reward_functions = reward_functions or {}  # reward name → deployed function (serverless)
        self.stateful_rewards = set(stateful_rewards)  # rewards that need an engine: always on the REWARD pool
        self.env_workers = list(env_workers)
        self.envs_on: Counter = Counter({a: 0 for a in env_workers})
        self.envs_of: Counter = Counter()  # (worker, task) → live envs, for per-task env_concurrency
        self.envs_peak: Counter = Counter()  # task → most live envs seen on one worker
        self._freed = asyncio.Event()  # an env slot was freed or a worker joined
        self.stage: dict[str, str] = {}  # trajectory id → stage it is in (for the watchdog)
        self.where: dict[str, str] = {}  # trajectory id → env worker
        self.counts: Counter = Counter()
        self._closing: set[asyncio.Task] = set()  # closes of cancelled or failed trajectories' envs, not yet answered
        self.profiler = None  # control/placement.py's Profiler: told of every training turn asked and answered
        self.placed: dict[str, str] = {}  # affinity auto: task → the affinity the run chose (control/placement.py), until then any

    def in_flight(self) -> Counter:
        """Trajectories in flight by stage (generate, env-step, reward, …)."""
        return Counter(self.stage.values())

    async def closes_done(self, timeout: float) -> int:
        """Wait (at most ``timeout`` s) for the env closes still in flight; returns how many were left unanswered.
        A run stops only after this: a close still queued when the dispatcher's channels shut would never reach its
        worker, and on an attached cluster (a long-lived env host) the env would outlive the run."""
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=timeout)
        return len(self._closing)

    def worker_lost(self, address: str) -> None:
        for workers in self.reward_workers.values():
            if address in workers:
                workers.remove(address)
        if address in self.env_workers:
            self.env_workers.remove(address)
            self.envs_on.pop(address, None)
            self._freed.set()  # trajectories waiting for a slot re-place (or fail with WorkerLost)

    def reward_worker_joined(self, address: str, pools) -> None:
        for pool in set(pools) & set(self.reward_workers):
            if address not in self.reward_workers[pool]:
                self.reward_workers[pool].append(address)

    def worker_joined(self, address: str) -> None:
        if address not in self.env_workers:
            self.env_workers.append(address)
            self.envs_on[address] = 0
            self._freed.set()

    async def _place(self, task: TaskConfig) -> str:
        """The least-loaded env worker with a free slot for this task (waits while all are full)."""
        limit = task.env_concurrency
        deadline = None
        while True:
            if not self.env_workers:  # lost; its Nanny or a replacement may bring one back: wait, never spin relaunches
                deadline = deadline or time.monotonic() + self.rollout.worker_wait_s
                if time.monotonic() >= deadline:
                    raise WorkerLost(f"no env worker in pool CPU for rollout.worker_wait_s={self.rollout.worker_wait_s:.0f} s")
                self._freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), deadline - time.monotonic())
                continue
            free = [a for a in self.env_workers if limit is None or self.envs_of[a, task.name] < limit]
            if free:
                return min(free, key=lambda a: self.envs_on[a])
            self._freed.clear()
            await self._freed.wait()

    async def _env(self, stage: str, fn, item: dict, worker: str, retries: int, task: TaskConfig):
        for attempt in range(retries + 1):
            if worker not in self.env_workers:
                raise WorkerLost(f"env worker {worker} left the cluster")
            try:
                return await self.d.call(
                    stage, fn, dict(item, attempt=attempt), pool="CPU", worker=worker, timeout=self.rollout.env_timeout_s, streamed=True
                )
            except (CallFailed, TimeoutError) as e:
                self.counts[f"{stage}_errors"] += 1
                if attempt == retries:
                    # an env under EMULATED fault injection (tasks[].inject) hangs on purpose: its timeouts stand for the
                    # infrastructure's, so they fail the trajectory (counted) but never trip the breaker on the user's code
                    emulated = task.inject is not None and isinstance(e, TimeoutError)
                    fault = e if emulated else as_user_fault(stage, task.name, e)
                    if fault is e:
                        raise
                    raise fault from e

    async def run(
        self, traj: Trajectory, task: TaskConfig, barrier: TurnBarrier | None = None, eval_temperature: float | None = None, on_start=None
    ) -> Trajectory:
        """Play one trajectory to its end and score it. Raises on failure; the caller counts it. ``eval_temperature``: an
        evaluation's episode at that temperature (0 greedy; uncounted, unprofiled); None: a training rollout at the engine's."""
        tid = traj.id
        evaluating = eval_temperature is not None
        in_barrier = barrier is not None
        self.stage[tid] = "env-wait"
        try:
            worker = await self._place(task)
        except BaseException:
            self.stage.pop(tid, None)
            if in_barrier:
                barrier.leave()
            raise
        self.envs_on[worker] += 1
        self.envs_of[worker, task.name] += 1
        self.envs_peak[task.name] = max(self.envs_peak[task.name], self.envs_of[worker, task.name])
        self.where[tid] = worker
        try:
            self.stage[tid] = "env-reset"
            reset = {
                "traj_id": tid,
                "env": task.env,
                "env_args": task.env_args,
                "seed": traj.seed,
                "inject": task.inject,
                "member": tid.rsplit("/", 1)[-1] if "/" in tid else "0",
            }
            obs, info = await self._env("env-reset", tasks.env_reset_stream, reset, worker, self.rollout.retries, task)
            choices = info.get("action_choices") if self.engine.constrained else None
            final_info: dict = {}
            emulate = info.get("emulate")  # an EMULATED workload env's lengths for the next turn
            budget = task.token_budget
            term = False
            chat = Conversation(task.prompt, task.max_turns)
            for turn in range(task.max_turns):
                if budget is not None and budget <= 0:
                    break  # token budget spent: truncated
                if in_barrier:
                    self.stage[tid] = "barrier"
                    await barrier.wait()
                self.stage[tid] = "generate"
                max_tokens = task.max_tokens if budget is None else min(task.max_tokens, budget)
                if self.profiler is not None and not evaluating:
                    self.profiler.asked(task.name, len(traj.turns), emulate, max_tokens)
                messages = chat.ask(obs)
                c = await self.proxy.generate(
                    tid,
                    lambda: task_pool(task, self.placed),
                    messages,
                    choices or None,
                    max_tokens,
                    self.engine.temperature if eval_temperature is None else eval_temperature,
                    emulate,
                    counted=not evaluating,
                    task=task.name,
                    stop=task.prompt.stop,
                    seed=None if traj.sampling_seed is None else mixed_seed(traj.sampling_seed, turn),
                )
                chat.answered(c.text)
                if self.profiler is not None and not evaluating:
                    self.profiler.observe(task.name, traj.turns, c)
                if budget is not None:
                    budget -= len(c.token_ids)
                if traj.version is None:  # the version of its first token (a continued turn's is older than its last)
                    traj.version = c.token_versions[0] if c.token_versions else c.version
                    if on_start is not None:
                        on_start(tid, traj.version)
                self.stage[tid] = "env-step"
                last = turn == task.max_turns - 1 or (budget is not None and budget <= 0)
                # env.step is not idempotent: no retry (a failed step fails the trajectory)
                nobs, r, term, trunc, final_info = await self._env(
                    "env-step", tasks.env_step_stream, {"traj_id": tid, "action": c.text, "last": last}, worker, 0, task
                )
                traj.turns.append(
                    Turn(
                        observation=obs,
                        prompt_ids=c.prompt_ids,
                        response_ids=c.token_ids,
                        logprobs=c.logprobs,
                        allowed_ids=c.allowed_ids,
                        version=c.version,
                        action=c.text,
                        env_reward=r,
                        token_versions=c.token_versions,
                        messages=messages,
                    )
                )
                obs, emulate = nobs, final_info.get("emulate")
                if term or trunc:
                    break
            if in_barrier:
                barrier.leave()
                in_barrier = False
            traj.info = dict(final_info, truncated=not term)  # out of turns (or a failed last step) rather than an ending
            self.stage[tid] = "reward"
            score = await self.score(task, traj)
            traj.reward = float(score["score"])
            traj.info["reward"] = score
            return traj
        except BaseException:
            if tid in self.where and worker in self.env_workers:
                closing = asyncio.ensure_future(self._close(tid, worker))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            raise
        finally:
            if in_barrier:
                barrier.leave()
            self.stage.pop(tid, None)
            self.where.pop(tid, None)
            if worker in self.envs_on:
                self.envs_on[worker] -= 1
            self.envs_of[worker, task.name] -= 1
            self._freed.set()
            self.proxy.forget(tid)

    async def score(self, task: TaskConfig, traj: Trajectory) -> dict:
        """The task's reward of a played trajectory, where the run scores it (retried; a user fault raised as UserCodeFailed)."""
        item = {"reward": task.reward, "function": self.reward_functions.get(task.reward), "trajectory": traj.for_reward()}
        pool = "REWARD" if task.reward in self.stateful_rewards else self.reward_pool  # a judge stays local in either mode
        for attempt in range(self.rollout.retries + 1):
            try:
                return await self.d.call(
                    "reward",
                    tasks.reward_batch,
                    dict(item),
                    pool=pool,
                    worker=self._reward_worker(pool),
                    timeout=self.rollout.reward_timeout_s,
                )
            except (CallFailed, TimeoutError, WorkerLost) as e:  # stateless: any reward worker may score it again
                self.counts["reward_errors"] += 1
                if attempt == self.rollout.retries:
                    fault = as_user_fault("reward", task.name, e)
                    if fault is e:
                        raise
                    raise fault from e

    def _reward_worker(self, pool: str) -> str | None:
        """The next of the pool's reward workers in turn (None: calls go to the pool and come back as task results)."""
        workers = self.reward_workers.get(pool)
        if not workers:
            return None
        self._reward_turn += 1
        return workers[self._reward_turn % len(workers)]

    async def _close(self, tid: str, worker: str) -> None:
        try:
            # a call still holding the env after env_timeout_s has outlived its caller: the close ends it
            await self.d.call(
                "env-close",
                tasks.env_close_batch,
                {"traj_id": tid, "hung_after_s": self.rollout.env_timeout_s},
                pool="CPU",
                worker=worker,
                timeout=2 * self.rollout.env_timeout_s,
            )
        except Exception:
            pass  # best effort: the env host also drops envs when a worker restarts
