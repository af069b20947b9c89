"""The run: launcher (admission under the staleness bound), trajectories, and the step loop
running RollArt's protocol — Get Batch → Suspend → Update weights → Resume → Recompute KV →
Train — with rollout going on while the trainer trains.

Modes share this code: ``sync`` (batch level, α=0: no overlap), ``one_off`` (batch level,
α=1) and ``rollart`` (trajectory level, any α). Admission: a group may start only while
groups admitted < (engine version + α + 1) × batch_groups, so nothing is started that the
staleness bound would certainly throw away; α=0 additionally waits for each training step
and its weight update before rollout goes on.
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from pathlib import Path

from . import dashboard, phases
from .algo.advantages import ADVANTAGES
from .buffer import Group, Orders, SampleBuffer
from .config import FlowConfig, TaskConfig, resolve_engine_backend, task_pool
from .dispatch import Dispatcher, WorkerLost
from .envmanager import EnvManager, TurnBarrier
from .observe import MetricsWriter, console
from .pools import ENGINE_POOLS, REWARD_POOL, PoolMap
from .reward_plane import RewardPlane
from .proxy import LLMProxy, TrajectoryCancelled
from .services import pd, plugins
from .types import Trajectory
from .weights.store import WeightStore


def needed_pools(cfg: FlowConfig) -> dict[str, str]:
    need = {"TRAIN": "trainer", "CPU": "env hosts", REWARD_POOL[cfg.reward.mode]: f"reward ({cfg.reward.mode})"}
    for t in cfg.tasks:
        pool = task_pool(t)
        if pool:
            need[pool] = f"engine for task {t.name} (affinity {t.affinity})"
    if cfg.rollout.pd:  # disaggregated: every generate call prefills on one pool and decodes on the other
        need.update({cfg.rollout.pd.prefill: "engine for rollout.pd.prefill", cfg.rollout.pd.decode: "engine for rollout.pd.decode"})
    return need


def engine_pools(cfg: FlowConfig, poolmap: PoolMap) -> list[str]:
    if cfg.rollout.pd:  # disaggregated: the engines of both phases, whatever the tasks' affinity
        return sorted({cfg.rollout.pd.prefill, cfg.rollout.pd.decode})
    pools = {task_pool(t) for t in cfg.tasks}
    if None in pools:  # affinity auto: every engine pool that has workers
        pools.discard(None)
        pools |= {p for p in ENGINE_POOLS if poolmap.engine_workers(p)}
    return sorted(pools)


class Run:
    def __init__(self, cfg: FlowConfig, client, out_dir: Path, model_dir: Path, resume: bool = False):
        self.cfg, self.client, self.out, self.model_dir, self.from_checkpoint = cfg, client, out_dir, model_dir, resume
        r = cfg.rollout
        self.B, self.G, self.alpha = r.batch_groups, r.group_size, r.alpha
        self.buffer = SampleBuffer(r.group_size, r.redundancy, r.alpha, r.max_relaunch)
        self.d = Dispatcher(client, coalesce=r.coalesce, max_inflight=r.coalesce_inflight)
        self.tasks = {t.name: t for t in cfg.tasks}
        self.rng = random.Random(cfg.seed)
        self.members: dict[str, asyncio.Task] = {}
        self.published = 0  # policy version: published optimizer updates
        self.counts: Counter = Counter()
        self.metrics = MetricsWriter(out_dir, cfg.observe.tensorboard)
        self.history: list[dict] = []  # eval results
        self._wake_launcher = asyncio.Event()
        self._wake_batch = asyncio.Event()
        self._stopping = False
        self.paused = False  # no new groups while paused (see pause())
        self._stop_requested = False  # stop after the current step (see request_stop())
        self._wave: list[str] = []
        self._last_progress = time.monotonic()
        self.weights: WeightStore | None = None  # publishes each version and stages it on the engines (weights/store.py)
        self._bg: list[asyncio.Task] = []
        self.t_start = time.monotonic()
        self._train_busy_s = 0.0
        self._base_version = 0
        self._fatal: Exception | None = None  # set by the worker monitor when the trainer or an engine is lost
        self.trained_ids: list[str] = []  # every trajectory that went into a batch, in order
        self.run_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"  # tells this run's dashboard snapshots from other runs' on the scheduler
        self.syncs: list[dict] = []  # one per weight sync: when, from and to which version, phase times (dashboard timeline)
        self.dashboard_url: str | None = None  # the RollArt page, once its plugin is on the scheduler
        self._run_span: dict | None = None  # Dask span of the whole run (see run())
        self._step_span: dict | None = None  # Dask span of the current training step (phases nest in it)
        self._rollout_span: dict | None = None  # Dask span of all rollout trajectories
        self._traj_s: list[float] = []  # rollout time of trajectories finished since the last step (launch → reward)
        self._reward_stats: list[dict] = []  # the reward runners' counters at the last pool_busy sample
        self.service_s: Counter = Counter()

    # -- set-up: resource plane + data plane ---------------------------------------------------
    async def setup(self) -> None:
        if self.cfg.rollout.pd:  # engine.backend auto resolves only now: vllm cannot disaggregate here (services/pd.py)
            pd.check_backend(resolve_engine_backend(self.cfg.engine))
        info = await self.client.scheduler.identity()
        self.poolmap = PoolMap.from_scheduler_info(info)
        self.poolmap.validate(needed_pools(self.cfg))
        self.dashboard_url, why = await dashboard.register(self.client)
        if why:
            console.print(f"[yellow]no RollArt dashboard page: {why} (it needs rollart_dask and bokeh where the scheduler runs)[/yellow]")
        self.trainer = self.poolmap.members("TRAIN")[0]
        self.weights = WeightStore(self.cfg.weights, self.d, self.trainer, self.out)
        await self.weights.start()  # weights.store=mooncake on the embedded default: a local mooncake_master
        pools = engine_pools(self.cfg, self.poolmap)
        engines = {p: self.poolmap.engine_workers(p) for p in pools}
        tr = self.cfg.trainer
        md = str(self.model_dir)
        await self.client.register_plugin(plugins.EnvHostPlugin(["CPU"]), name=plugins.ENVHOST)
        self.rewards = RewardPlane(self.cfg, self.out)
        self.reward_pool = self.rewards.pool
        reward_spec = await self.rewards.start()
        await self.client.register_plugin(plugins.RewardPlugin([self.reward_pool], **reward_spec), name=plugins.REWARD)
        self.engine_backend = resolve_engine_backend(self.cfg.engine)
        emulated = {"emulation": self.cfg.emulation.model_dump()} if self.cfg.emulated else {}  # EMULATED timing profiles
        await self.client.register_plugin(plugins.EnginePlugin(pools, exclude=["TRAIN"], model_dir=md, seed=self.cfg.seed, max_batch=self.cfg.engine.max_batch,
                                                               gpu_memory_utilization=self.cfg.engine.gpu_memory_utilization,
                                                               sleep_level=self.cfg.engine.sleep_level,
                                                               backend=self.engine_backend, **emulated), name=plugins.ENGINE)
        await self.client.register_plugin(
            plugins.TrainerPlugin(["TRAIN"], model_dir=md, lr=tr.lr, weight_decay=tr.weight_decay, clip=tr.clip, entropy_coef=tr.entropy_coef,
                                  max_grad_norm=tr.max_grad_norm, temperature=self.cfg.engine.temperature, seed=self.cfg.seed,
                                  micro_batch_tokens=tr.micro_batch_tokens, backend=tr.backend, megatron=tr.megatron.model_dump(), **emulated),
            name=plugins.TRAINER)
        # the emulated engine batches continuously across calls (a real engine runs one batch per call)
        self.proxy = LLMProxy(self.d, engines, timeout_s=self.cfg.rollout.generate_timeout_s, streamed=self.cfg.emulated, pd=self.cfg.rollout.pd)
        self.em = EnvManager(self.d, self.proxy, self.poolmap.members("CPU"), self.cfg.rollout, self.cfg.engine,
                             reward_pool=self.reward_pool, reward_functions=self.rewards.functions, stateful_rewards=self.rewards.stateful)
        self.layout = {p: [self.poolmap.name(a) for a in addrs] for p, addrs in engines.items()}
        if self.from_checkpoint:
            await self._restore()
        elif self.cfg.warmstart.steps:
            await self._warm_start()
        self._base_version = self.proxy.version  # admission counts groups from here

    async def _restore(self) -> None:
        latest = self.out / "checkpoints" / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"--resume: no checkpoint under {latest.parent}")
        path = latest.read_text().strip()
        fut = self.d.submit_one("restore", plugins.trainer_restore, path, pool="TRAIN", worker=self.trainer)
        self.published = await fut
        self.weights.publish(self.published, self.proxy.pool_of, after=fut, setup=True)
        await self._sync_weights()
        console.print(f"resumed from {path} at version {self.published}")

    async def _warm_start(self) -> None:
        """Imitate each task's expert before RL (demonstrations played on the env workers, SFT on
        the trainer), publish the result as version 1 and sync the engines: the first held-out
        evaluation then measures the warm-started policy, so it is never counted as RL gain."""
        ws, t0 = self.cfg.warmstart, time.monotonic()
        names = ws.tasks or list(self.tasks)
        cpu = self.poolmap.members("CPU")
        rng = random.Random(self.cfg.seed + 1)  # training seeds only: held-out seeds lie at eval.start_seed and above
        futs = []
        for i, name in enumerate(names):
            t = self.tasks[name]
            item = {"task": name, "env": t.env, "env_args": t.env_args, "max_turns": t.max_turns, "max_tokens": t.max_tokens,
                    "seeds": [rng.randrange(0, self.cfg.eval.start_seed) for _ in range(ws.episodes)]}
            futs.append(self.d.submit_one("warmstart-demos", plugins.env_expert_demos, item, pool="CPU", worker=cpu[i % len(cpu)]))
        demos = [d for batch in await asyncio.gather(*futs) for d in batch]
        fut = self.d.submit_one("warmstart", plugins.trainer_warm_start, demos, ws.steps, ws.batch, ws.lr, self.cfg.seed, ws.tasks,
                                pool="TRAIN", worker=self.trainer)
        m = await fut
        self.published = int(m.pop("version"))
        self.weights.publish(self.published, self.proxy.pool_of, after=fut, setup=True)
        await self._sync_weights()
        per_task = Counter(d["task"] for d in demos)
        row = {"kind": "warmstart", "step": self.published, "version": self.published, "turns_per_task": dict(per_task),
               "elapsed_s": time.monotonic() - t0, **m}
        self.metrics.write(row)
        console.print(f"warm start: {m['steps']} imitation steps on {m['samples']} expert turns ({dict(per_task)}; {m['skipped']} did not fit "
                      f"the decoding) in {row['elapsed_s']:.0f}s, NLL {m['nll_first']:.3f} → {m['nll_last']:.3f}; "
                      f"held-out scores below start from this policy")

    # -- steering (from the Python API; call on the run's event loop) ---------------------------------
    def pause(self) -> None:
        """Open no new groups. Trajectories in flight go on and finish; finished groups still train."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake_launcher.set()

    def request_stop(self) -> None:
        """End after the current step: the pending train step is published, then the final
        evaluation and checkpoint run as at a normal end."""
        self._stop_requested = True
        self._wake_batch.set()

    # -- launching trajectories ----------------------------------------------------------------
    def _limit(self) -> int:
        """Groups that may have been admitted so far. ``safe``: none that would be stale if groups were
        consumed in admission order (engine version + α + 1 batches). ``eager`` (the paper's): up to
        (α + 1) batches not yet trained, in flight or ready; those that outlive the bound are aborted."""
        if self.cfg.rollout.admission == "eager" and self.alpha > 0:
            return self.buffer.counts["groups_trained"] + (self.alpha + 1) * self.B
        return (self.proxy.version - self._base_version + self.alpha + 1) * self.B

    def _open_group(self, barrier: TurnBarrier | None) -> str:
        names = list(self.tasks)
        task = self.rng.choices(names, weights=[self.tasks[n].weight for n in names])[0]
        gid = f"g{self.buffer.opened}-{uuid.uuid4().hex[:6]}"
        seed = self.rng.randrange(0, self.cfg.eval.start_seed)
        size = self.tasks[task].group_size or self.G
        if barrier is not None:
            barrier.parties += size + self.cfg.rollout.redundancy
        self._carry_out(self.buffer.open_group(gid, task, seed, size), barrier)
        return gid

    async def _launcher(self) -> None:
        level = self.cfg.rollout.level
        while not self._stopping:
            if self.paused:
                pass
            elif level == "trajectory":
                while self.buffer.admitted < self._limit() and not self._stopping and not self.paused:
                    self._open_group(None)
            elif self._wave_done() and self.buffer.admitted + self.B <= self._limit():
                barrier = TurnBarrier(0)  # each opened group adds its members
                self._wave = [self._open_group(barrier) for _ in range(self.B)]
            self._wake_launcher.clear()
            await self._wake_launcher.wait()

    def _wave_done(self) -> bool:
        return all(g not in self.buffer.groups or not self.buffer.groups[g].running() for g in self._wave)

    def _carry_out(self, orders: Orders, barrier: TurnBarrier | None = None) -> None:
        for gid, tid in orders.launch:
            g = self.buffer.groups[gid]
            traj = Trajectory(id=tid, group_id=gid, task=g.task, seed=g.seed)
            self.members[tid] = asyncio.ensure_future(self._member(traj, self.tasks[g.task], barrier))
        if orders.cancel:
            asyncio.ensure_future(self._cancel(orders.cancel))
            for tid in orders.cancel:
                task = self.members.get(tid)
                if task is not None:
                    task.cancel()

    async def _cancel(self, traj_ids: list[str]) -> None:
        """Abort the engine requests of cancelled trajectories; a failed abort is counted (the request
        then runs to its end and its answer is dropped), and ignored once the run is stopping."""
        try:
            await self.proxy.cancel(traj_ids)
        except Exception:
            if not self._stopping:
                self.counts["abort_errors"] += 1

    async def _member(self, traj: Trajectory, task: TaskConfig, barrier: TurnBarrier | None) -> None:
        orders = Orders()
        t0 = time.monotonic()
        try:
            # a member started from inside a phase (a replacement) still counts as rollout, not as that phase
            with phases.within(self._rollout_span):
                await self.em.run(traj, task, barrier, on_start=self.buffer.started)
            orders = self.buffer.finished(traj)
            self._traj_s.append(time.monotonic() - t0)
            self.counts["turns"] += len(traj.turns)
            self._last_progress = time.monotonic()  # only a finished trajectory is progress, not a failure
        except (TrajectoryCancelled, asyncio.CancelledError):
            return  # the buffer ordered it and counted it
        except WorkerLost:
            orders = self.buffer.failed(traj.id, "env_worker_lost")
        except Exception as e:
            reason = f"failed_{type(e).__name__}"
            if self.counts[reason] < 3:
                console.print(f"[yellow]trajectory {traj.id} ({traj.task}) failed: {e}[/yellow]")
            self.counts[reason] += 1
            orders = self.buffer.failed(traj.id, "failed")
        finally:
            self.members.pop(traj.id, None)
            self._wake_batch.set()
            self._wake_launcher.set()
        self._carry_out(orders)

    # -- the protocol ---------------------------------------------------------------------------
    async def _get_batch(self) -> list[Group] | None:
        """The next batch, or None when a stop was requested."""
        while True:
            if self._stop_requested:
                return None
            if self._fatal:  # a lost engine or trainer: stop now rather than wait for a batch that cannot come
                raise self._fatal
            self._carry_out(self.buffer.enforce_staleness(self.published))
            groups = self.buffer.take(self.B)
            if groups is not None:
                self._wake_launcher.set()  # eager admission counts trained groups: room for more
                return groups
            self._wake_batch.clear()
            await self._wake_batch.wait()

    async def _sync_weights(self) -> dict:
        """Suspend → Update weights → Resume → Recompute KV, when a newer version is published.
        Engines pull the new version while they generate with the old one: the loop waits for the
        rest of that pull before Suspend, so rollout never stops for it (nor does the trainer:
        the next Train is already submitted)."""
        if self.published <= self.proxy.version:
            return {}
        t = {}
        with phases.phase(self._step_span, "pull-weights"):
            t["weights"] = await self.weights.wait_staged()
        started, previous = time.monotonic(), self.proxy.version
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "suspend"):
            await self.proxy.suspend()
        t["suspend_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "update-weights"):
            await self.proxy.update_weights(self.published)  # the swap of the staged weights
        t["update_s"] = time.perf_counter() - t0
        with phases.phase(self._step_span, "resume"):
            self.proxy.resume()
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "recompute-kv"):
            await self.proxy.reset_prefix_cache()  # aborted turns re-prefill under the new weights
        t["recompute_kv_s"] = time.perf_counter() - t0
        self.syncs.append({"at": started, "from": previous, "version": self.published, **t})
        self._carry_out(self.buffer.enforce_staleness(self.published))
        self._wake_launcher.set()
        return t

    def _samples(self, groups: list[Group]) -> tuple[list[dict], dict]:
        adv_fn = ADVANTAGES["grpo"]
        samples, rewards, varied, success = [], [], 0, []
        per_task: dict[str, dict] = {}
        for g in groups:
            rs = [t.reward for t in g.kept]
            advs = adv_fn(rs)
            varied += int(any(a != 0 for a in advs))
            rewards += rs
            pt = per_task.setdefault(g.task, {"groups": 0, "trajectories": 0, "reward_sum": 0.0, "success_sum": 0.0, "turns": 0})
            pt["groups"] += 1
            for traj, a in zip(g.kept, advs):
                success.append(float(traj.success))
                pt["trajectories"] += 1
                pt["reward_sum"] += traj.reward
                pt["success_sum"] += float(traj.success)
                pt["turns"] += len(traj.turns)
                for turn in traj.turns:
                    samples.append({"prompt_ids": turn.prompt_ids, "response_ids": turn.response_ids, "logprobs": turn.logprobs,
                                    "allowed_ids": turn.allowed_ids, "advantage": a})
        stats = {"trajectories": len(rewards), "reward_mean": sum(rewards) / len(rewards), "success": sum(success) / len(success),
                 "groups_with_signal": varied / len(groups), "turns_per_traj": len(samples) / len(rewards),
                 "tasks": {name: {"groups": pt["groups"], "trajectories": pt["trajectories"], "reward_mean": pt["reward_sum"] / pt["trajectories"],
                                  "success": pt["success_sum"] / pt["trajectories"], "turns_per_traj": pt["turns"] / pt["trajectories"]}
                           for name, pt in per_task.items()}}
        return samples, stats

    async def _train(self, groups: list[Group], row: dict):
        self.trained_ids += [t.id for g in groups for t in g.kept]
        samples, stats = self._samples(groups)
        stats.update(row)
        stale = Counter(self.buffer.staleness(self.published, groups))  # trainer version at Train − start version
        stats["staleness"] = {str(k): v for k, v in sorted(stale.items())}
        # ordered after the publish of the version it starts from (the publish reads the weights this step changes)
        fut = self.d.submit_one("train", plugins.trainer_step, samples, self.weights.publishing, pool="TRAIN", worker=self.trainer)
        return fut, stats

    async def _finish_train(self, pending) -> dict:
        fut, stats = pending
        t0 = time.perf_counter()
        metrics = await asyncio.wait_for(fut, 600)
        stats["wait_train_s"] = time.perf_counter() - t0
        self.published = int(metrics["version"])
        self._train_busy_s += metrics["train_s"]
        self.weights.publish(self.published, self.proxy.pool_of, after=fut)
        every = self.cfg.trainer.checkpoint_every
        if every and self.published % every == 0:
            await self.checkpoint(after=fut)
        self._last_progress = time.monotonic()
        return {**stats, **{k: v for k, v in metrics.items() if k != "version"}}

    # -- evaluation -----------------------------------------------------------------------------
    async def evaluate(self) -> dict:
        """Greedy on the fixed held-out seeds of every task, at the engines' current version."""
        version = self.proxy.version
        t0 = time.monotonic()

        async def one(task: TaskConfig) -> dict:
            n = task.eval_seeds or self.cfg.eval.seeds
            seeds = range(self.cfg.eval.start_seed, self.cfg.eval.start_seed + n)
            trajs = [Trajectory(id=f"eval-v{version}-{task.name}-{s}", group_id="eval", task=task.name, seed=s) for s in seeds]
            results = await asyncio.gather(*(self.em.run(t, task, greedy=True) for t in trajs), return_exceptions=True)
            ok = [r for r in results if isinstance(r, Trajectory)]
            return {"success": sum(float(t.success) for t in ok) / n, "reward_mean": sum(t.reward for t in ok) / max(len(ok), 1),
                    "failed_calls": n - len(ok), "seeds": n, "seconds": round(time.monotonic() - t0, 2)}

        if self.cfg.emulated:  # EMULATED: synthetic tokens, no policy to score
            out = {}
        else:  # all tasks at once: a slow task (sandboxed code) does not serialise behind the others
            results = await asyncio.gather(*(one(task) for task in self.cfg.tasks))
            out = {task.name: r for task, r in zip(self.cfg.tasks, results)}
        row = {"kind": "eval", "step": version, "version": version, "eval": out, "elapsed_s": time.monotonic() - self.t_start,
               "eval_s": time.monotonic() - t0}
        self.history.append(row)
        self.metrics.write(row)
        return out

    # -- background: watchdog and worker monitor -------------------------------------------------
    async def _watchdog(self) -> None:
        """Report a run that makes no progress: what is in flight, where, and every coroutine's stack."""
        limit = self.cfg.observe.watchdog_s
        while not self._stopping:
            await asyncio.sleep(min(5.0, limit / 4))
            idle = time.monotonic() - self._last_progress
            if idle <= limit:
                continue
            stages = Counter(self.em.stage.values())
            where = Counter(self.poolmap.name(a) for a in self.em.where.values())
            msg = (f"watchdog: no progress for {idle:.0f}s — in flight by stage {dict(stages)}, envs by worker {dict(where)}, "
                   f"suspended={self.proxy.suspended}, engines v{self.proxy.version}, policy v{self.published}, "
                   f"buffer ready {self.buffer.ready()}/{self.B}, open calls {self.d.open_calls()}")
            console.print(f"[red]{msg}[/red]")
            with (self.out / "watchdog.txt").open("a") as f:
                f.write(msg + "\n")
                for task in asyncio.all_tasks():
                    f.write(f"--- {task.get_name()}\n")
                    task.print_stack(limit=8, file=f)
            self.counts["watchdog_alerts"] += 1
            self._last_progress = time.monotonic()

    async def _monitor(self) -> None:
        known = set(self.poolmap.workers)
        while not self._stopping:
            await asyncio.sleep(1.0)
            try:
                info = await asyncio.wait_for(self.client.scheduler.identity(), 10)
            except Exception:
                continue
            current = PoolMap.from_scheduler_info(info)
            now = set(current.workers)
            for addr in known - now:
                lost = self.d.worker_lost(addr)
                self.em.worker_lost(addr)
                self.counts["workers_lost"] += 1
                console.print(f"[yellow]worker {self.poolmap.name(addr)} left the cluster ({lost} calls failed over)[/yellow]")
                if addr == self.trainer or addr in self.proxy.pool_of:
                    self._fatal = RuntimeError(f"worker {self.poolmap.name(addr)} holding the trainer or an engine was lost; restart the run with --resume")
                    self._wake_batch.set()
            for addr in now - known:
                self.poolmap.workers[addr] = current.workers[addr]
                if "CPU" in current.workers[addr]["resources"]:
                    self.em.worker_joined(addr)
            known = now

    async def _publish(self) -> None:
        """The dashboard snapshot to the scheduler about once a second (see rollart_dask/dashboard)."""
        while not self._stopping:
            if not await dashboard.publish(self.client, self):
                self.counts["dashboard_publish_failed"] += 1
            await asyncio.sleep(1.0)

    # -- the whole run --------------------------------------------------------------------------
    async def pool_busy(self, prev: dict | None, dt: float) -> tuple[dict, dict]:
        """Busy fraction per pool since the last call: service busy seconds / (wall × services in the pool)."""
        try:
            stats = await asyncio.wait_for(self.client.run(plugins.service_stats), 30)
        except (asyncio.TimeoutError, OSError):  # a busy or departing worker: skip this sample, never the run
            self.counts["stats_timeouts"] += 1
            return prev or {}, {}
        busy: Counter = Counter()
        holders: Counter = Counter()
        flat = {}
        self._reward_stats = [services[plugins.REWARD] for services in stats.values() if plugins.REWARD in services]
        self._engine_stats = {addr: services[plugins.ENGINE] for addr, services in stats.items() if plugins.ENGINE in services}
        self.service_s: Counter = Counter()  # per stage: seconds the calls spent inside the services (vs. the caller's wall)
        for addr, services in stats.items():
            for service, st in services.items():
                pool = {plugins.ENVHOST: "CPU", plugins.REWARD: self.reward_pool}.get(service) or self.proxy.pool_of.get(addr, "?")
                flat[(addr, service)] = st["busy_s"]
                busy[pool] += st["busy_s"] - (prev or {}).get((addr, service), 0.0)
                holders[pool] += 1
                for stage, key in (("generate", "request_s"), ("env-reset", "resets_s"), ("env-step", "steps_s")):
                    if key in st:
                        flat[(addr, service, key)] = st[key]
                        self.service_s[stage] += st[key] - (prev or {}).get((addr, service, key), 0.0)
        busy["TRAIN"], holders["TRAIN"], self._train_busy_s = self._train_busy_s, 1, 0.0
        return flat, {p: round(v / max(dt, 1e-9) / holders[p], 4) for p, v in busy.items()}

    async def run(self, on_step=None) -> dict:
        """Run the flow to its end; returns first/last held-out evaluations and the counts."""
        cfg = self.cfg
        t_start = self.t_start = self._last_progress = time.monotonic()  # set-up (model loads, warm start) is not a stall
        # one Dask span for the run: the first evaluation, rollout and every step nest in it
        self._run_span = self._step_span = phases.new_span("rollart")
        self._rollout_span = phases.new_span("rollout", parent=self._run_span)
        self._bg = [asyncio.ensure_future(c) for c in (self._launcher(), self._watchdog(), self._monitor(), self._publish())]
        try:
            with phases.phase(self._step_span, "eval"):
                await self.evaluate()
            if on_step:
                on_step(self)
            pending = None
            prev_busy, _ = await self.pool_busy(None, 1.0)
            t_prev = time.monotonic()
            steps_done = 0
            while steps_done < cfg.trainer.steps:
                # a Dask span per step, named like the metrics row its Train publishes; each phase is a span inside it
                self._step_span = phases.new_span(f"step-{self._base_version + steps_done + 1}", parent=self._run_span)
                if pending is not None:  # the previous Train publishes its version first: the batch below trains at it,
                    with phases.phase(self._step_span, "wait-train"):  # so its staleness is checked against it
                        self._emit(await self._finish_train(pending))
                    pending = None
                t0 = time.perf_counter()
                with phases.phase(self._step_span, "get-batch"):
                    groups = await self._get_batch()  # 1. Get Batch
                if groups is None:
                    console.print(f"stop requested: ending after {steps_done} steps")
                    break
                row: dict = {"get_batch_s": time.perf_counter() - t0}
                now = time.monotonic()
                prev_busy, busy = await self.pool_busy(prev_busy, now - t_prev)
                tokens = sum(len(t.response_ids) for g in groups for tr in g.kept for t in tr.turns)
                row["reward"] = self.rewards.step_stats(self._reward_stats, now - t_prev, self._reward_slots())
                if cfg.rollout.pd:  # KV bytes shipped, prefill / decode engine seconds (totals so far)
                    row["pd"] = pd.run_metrics(getattr(self, "_engine_stats", {}))
                row.update(pool_busy=busy, tokens_per_s=tokens / max(now - t_prev, 1e-9), elapsed_s=now - t_start,
                           buffer=dict(self.buffer.counts), futures=self.d.futures, calls=self.d.calls, reissued=self.proxy.reissued,
                           stage_latency=self.d.drain_stats(), trajectory_s=self._drain_traj_s(), service_s=dict(self.service_s))
                t_prev = now
                with phases.phase(self._step_span, "train"):
                    pending = await self._train(groups, row)  # 6. Train (rollout goes on meanwhile)
                # 2-5. Suspend -> Update -> Resume -> Recompute KV. After Train is submitted: the batch trains at the
                # published version whatever the engines run, so the trainer never waits for the engines' pull and swap.
                pending[1].update(await self._sync_weights())
                steps_done += 1
                if self.alpha == 0:  # on-policy: training and the weight update finish before rollout goes on
                    with phases.phase(self._step_span, "wait-train"):
                        stats = await self._finish_train(pending)
                    pending = None
                    stats.update(await self._sync_weights())
                    self._emit(stats)
                if cfg.eval.every and self.proxy.version % cfg.eval.every == 0 and self.proxy.version > self.history[-1]["version"]:
                    with phases.phase(self._step_span, "eval"):
                        await self.evaluate()
                if on_step:
                    on_step(self)
                if cfg.trainer.max_minutes and (time.monotonic() - t_start) > cfg.trainer.max_minutes * 60:
                    console.print(f"time limit of {cfg.trainer.max_minutes} min reached after {steps_done} steps")
                    break
            if pending is not None:
                with phases.phase(self._step_span, "wait-train"):
                    self._emit(await self._finish_train(pending))
            await self._sync_weights()  # the last published version (also when a stop ended the loop) reaches the engines
            if self.history[-1]["version"] != self.proxy.version:
                with phases.phase(self._step_span, "eval"):
                    await self.evaluate()
            if on_step:
                on_step(self)
            ckpt = await self.checkpoint()
            return {"first": self.history[0], "last": self.history[-1], "checkpoint": ckpt, "elapsed_s": time.monotonic() - t_start,
                    "counts": {**self.buffer.counts, **self.counts, **self.em.counts}, "steps": self.published - self._base_version,
                    "weights": self.weights.summary(),
                    **({"pd": pd.run_metrics(getattr(self, "_engine_stats", {}))} if cfg.rollout.pd else {})}  # totals at the last step
        finally:
            await self.stop()

    def _reward_slots(self) -> int:
        """Local rewards scored at once: per REWARD worker, its task threads or the batches in flight to it,
        whichever is fewer (each batch is scored in turn); the utilisation divides by this capacity."""
        if self.cfg.reward.mode != "local":
            return len(self._reward_stats)
        inflight = self.cfg.rollout.coalesce_inflight if self.cfg.rollout.coalesce else 10**9
        return sum(min(self.poolmap.workers[a].get("nthreads", 1), inflight) for a in self.poolmap.members("REWARD")) or 1

    def _drain_traj_s(self) -> dict:
        xs, self._traj_s = sorted(self._traj_s), []
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))]}

    def _emit(self, row: dict) -> None:
        row = {"kind": "step", "step": self.published, "version": self.published, **row}
        self.metrics.write(row)

    async def checkpoint(self, after=None) -> str:
        """Save an HF checkpoint of the trainer (ordered after the train future ``after``)."""
        path = self.out / "checkpoints" / f"step-{self.published}"
        fut = self.d.submit_one("checkpoint", plugins.trainer_checkpoint, str(path.resolve()), after, pool="TRAIN", worker=self.trainer)
        saved = await fut
        (self.out / "checkpoints" / "latest").write_text(saved)
        return saved

    async def stop(self) -> None:
        if self._bg and not self._stopping:  # the page shows the run's end, not its last second
            await dashboard.publish(self.client, self, final=True)
        self._stopping = True
        self._wake_launcher.set()
        for t in self._bg:
            t.cancel()
        members = list(self.members.values())
        for t in members:
            t.cancel()
        await asyncio.gather(*self._bg, *members, return_exceptions=True)
        try:
            self.metrics.close()
            self.d.close()
            if getattr(self, "rewards", None) is not None:
                await asyncio.to_thread(self.rewards.close)
        finally:
            if self.weights is not None:  # never leave a mooncake_master behind
                await self.weights.close()
