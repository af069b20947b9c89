"""The run: RollArt's training protocol, step by step, while rollout goes on around it.

Everything else a run needs lives beside it: service wiring (wiring.py), launching trajectories
under the staleness bound (launcher.py), telemetry (telemetry.py), training samples
(algo/samples.py). Modes share this code: ``sync`` (batch level, α=0: no overlap), ``one_off``
(batch level, α=1) and ``rollart`` (trajectory level, any α).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable

from rollart_dask.algo.advantages import advantage_fn
from rollart_dask.algo.samples import build_samples
from rollart_dask.config import FlowConfig, TaskConfig
from rollart_dask.control import elastic, evaluation, membership, phases, placement, stopping, wiring
from rollart_dask.control.buffer import Group, SampleBuffer
from rollart_dask.control.collector import fewer_collections
from rollart_dask.control.dispatch import Dispatcher
from rollart_dask.control.launcher import Launcher
from rollart_dask.control.recovery import TrainerRecovery
from rollart_dask.control.snapshot import build_snapshot
from rollart_dask.control.status import RunStatus
from rollart_dask.control.steprecord import StepRecord
from rollart_dask.control.telemetry import Telemetry
from rollart_dask.data import tasks
from rollart_dask.observe import MetricsWriter, console


class Run:
    def __init__(
        self, cfg: FlowConfig, client, out_dir: Path, model_dir: Path, resume: bool | Path = False, start_endpoint: Callable | None = None
    ):
        self.cfg, self.client, self.out, self.model_dir = cfg, client, out_dir, model_dir
        self.from_checkpoint, self.start_endpoint = resume, start_endpoint
        r = cfg.rollout
        self.B, self.alpha = r.batch_groups, r.alpha
        self.buffer = SampleBuffer(r.group_size, r.redundancy, r.alpha, r.max_relaunch, r.fairness, r.lag_bound, ordered=r.deterministic)
        self.d = Dispatcher(client, coalesce=r.coalesce, max_inflight=r.coalesce_inflight)
        self.metrics = MetricsWriter(out_dir, cfg.observe, cfg.model_dump(mode="json"))  # (the flow: each tracker's config)
        self.final_checkpoint: str | None = None  # written at the run's end: the trackers' artefact
        self.run_id = f"{cfg.name}-{uuid.uuid4().hex[:8]}"  # tells this run's dashboard snapshots from other runs' on the scheduler
        self.history: list[dict] = []  # evaluations
        self.outcomes: dict[str, dict[int, dict]] = {}  # the last evaluation's outcomes: task → seed → success, reward
        self.syncs: list[dict] = []  # one per weight installation: when, from and to which version, phase times
        self.trained_ids: list[str] = []  # every trajectory that went into a batch, in order
        self.dashboard_url: str | None = None  # the RollArt page, when the entry point registered it
        self.cluster = None  # the embedded cluster, when the entry point started one (None: attached)
        self.status = RunStatus()  # the version, the counters, how it fails: what recovery and elasticity are given
        self.services: wiring.Services | None = None
        self.launcher: Launcher | None = None
        self.telemetry = Telemetry(cfg, self.status, self.buffer, out_dir, lambda final: build_snapshot(self, final=final))
        self.recovery = TrainerRecovery(cfg, self.status)  # what re-creates a lost trainer (control/recovery.py)
        self.stopped = self._stop_requested = False  # (stopped: stop() has run)
        self.stop_reason = "stop requested"  # what ended the run early, as printed
        self._training: tuple | None = None  # (train future, its StepRecord) until the trainer has published
        self._run_span = self._step_span = None  # Dask spans: the whole run's, and the step's that nests in it
        self._sync: dict = {}  # the weight installation in progress (steps 2–5)
        self._installed = False  # steps 2–4 installed a version: step 5 recomputes the KV caches
        self._bg: list[asyncio.Task] = []
        self._unwatch: Callable[[], None] = lambda: None
        self._weights = None  # the weight store as soon as set-up made it (closed even if set-up fails later)
        self.elastic = elastic.Elasticity(cfg, self.status)  # engines that leave and join (control/elastic.py)
        self.placement: placement.AutoPlacement | None = None  # tasks with affinity auto (control/placement.py)

    # -- set-up -------------------------------------------------------------------------------------
    async def setup(self) -> None:
        s = self.services = await wiring.wire(
            self.cfg, self.client, self.out, self.model_dir, self.d, self.start_endpoint, on_weights=lambda w: setattr(self, "_weights", w)
        )
        self.launcher = Launcher(self.cfg, self.buffer, s.proxy, s.em, self.counts, on_fatal=self.status.fail)
        self.status.on_fail(self.launcher.batch_ready.set)
        self.telemetry.attach(s, self.launcher)
        self.recovery.attach(s)
        self.placement = await placement.attach(self.cfg, self.out, s)
        self.elastic.attach(s)
        if self.from_checkpoint:
            path, self.published = await wiring.restore(s, self.out, None if self.from_checkpoint is True else self.from_checkpoint)
            self.recovery.checkpointed(path, self.published)
        elif self.cfg.warmstart.steps:
            self.published = await wiring.warm_start(s, self.cfg, self.metrics, self.recovery.trained)
        await self._install_published()
        self.launcher.base_version = s.proxy.version  # admission counts groups from here

    # -- public state (the dashboard feed, the Python API) -------------------------------------------
    @property
    def state(self) -> str:
        stopping = self._stop_requested or (self.launcher is not None and self.launcher.stopping)
        return "stopping" if stopping else "paused" if self.paused else "running"

    @property
    def paused(self) -> bool:
        return self.launcher is not None and self.launcher.paused

    @property
    def engine_version(self) -> int:
        return self.services.proxy.version

    def in_flight(self) -> Counter:
        """Trajectories in flight by stage (generate, env-step, reward, …)."""
        return self.services.em.in_flight()

    @property
    def published(self) -> int:  # policy version: published optimizer updates
        return self.status.published

    @published.setter
    def published(self, version: int) -> None:
        self.status.published = version

    @property
    def counts(self) -> Counter:
        return self.status.counts

    # -- steering (from the Python API; call on the run's event loop) ---------------------------------
    def pause(self) -> None:
        """Open no new groups. Trajectories in flight go on and finish; finished groups still train."""
        self.launcher.paused = True

    def resume(self) -> None:
        self.launcher.paused = False
        self.launcher.wake()

    def request_stop(self) -> None:
        """End after the current step: the pending train step is published, then the final
        evaluation and checkpoint run as at a normal end."""
        self._stop_requested = True
        self.launcher.batch_ready.set()

    # -- the protocol -------------------------------------------------------------------------------
    async def step(self, number: int) -> bool:
        """One training step: the paper's six steps, in order. False when a stop was requested.

        Rollout never stops for the trainer: Train (6) only submits the batch, and the trainer works
        while rollout goes on. So the version the trainer publishes in step k is installed by steps
        2–5 of step k+1, once the next batch is in hand (1): the engines pulled it in the background
        meanwhile, and rollout is suspended only for the swap. That is the one-step overlap behind
        α: a batch trains at the version the previous Train published, against which Get Batch checks
        its staleness. With α = 0 (on-policy) Train waits for its own update and installs it at once,
        so rollout goes on only with the new weights and steps 2–5 of the next step find nothing new.
        """
        rec = StepRecord(step=number)
        self._step_span = phases.new_span(f"step-{self.launcher.base_version + number}", parent=self._run_span)
        batch = await self.get_batch(rec)  # 1. Get Batch
        if batch is None:
            return False
        await self.suspend(rec)  # 2. Suspend
        await self.update_weights(rec)  # 3. Update weights
        await self.resume_rollout(rec)  # 4. Resume
        await self.recompute_kv(rec)  # 5. Recompute KV
        await self.train(batch, rec)  # 6. Train
        return True

    async def get_batch(self, rec: StepRecord) -> list[Group] | None:
        """1. The next batch_groups finished groups within the staleness bound (None: a stop request), once the previous Train published."""
        await self.finish_training()
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "get-batch"):
            while not self._stop_requested:
                if self.status.fatal:  # a lost engine or trainer: stop now rather than wait for a batch that cannot come
                    raise self.status.fatal
                self.launcher.carry_out(self.buffer.enforce_staleness(self.published))
                groups = self.buffer.take(self.B)
                if groups is not None:
                    self.launcher.wake()  # eager admission counts trained groups: room for more
                    rec.phases["get_batch_s"] = time.perf_counter() - t0
                    rec.rollout = await self.telemetry.rollout_row(groups)
                    return groups
                self.launcher.batch_ready.clear()
                await self.launcher.batch_ready.wait()
        console.print(f"{self.stop_reason}: ending after {rec.step - 1} steps")
        return None

    def _newer_version(self) -> bool:
        return self.published > self.services.proxy.version

    async def suspend(self, rec: StepRecord | None) -> None:
        """2. When a newer version is published: wait for the engines' background pull of it (rollout
        goes on meanwhile), then suspend generation (requests in flight are aborted, re-issued at Resume)."""
        if not self._newer_version():
            return
        s = self.services
        at_update = self.cfg.weights.pull == "at_update"  # the synchronous baseline: pulled with generation suspended
        if not at_update:
            with phases.phase(self._step_span, "pull-weights"):
                pulled = await s.weights.wait_staged()
        self._sync = {"at": time.monotonic(), "from": s.proxy.version, "version": self.published}
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "suspend"):
            await s.proxy.suspend()
        self._sync["suspend_s"] = time.perf_counter() - t0
        if at_update:
            with phases.phase(self._step_span, "pull-weights"):
                pulled = await s.weights.wait_staged()
        if rec is not None:
            rec.weights = pulled

    async def update_weights(self, rec: StepRecord | None) -> None:
        """3. Swap the staged weights in on every engine."""
        if not self.services.proxy.suspended:
            return
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "update-weights"):
            async with self.elastic.weights_turn:
                await self.services.proxy.update_weights(self.published)
        self._sync["update_s"] = time.perf_counter() - t0

    async def resume_rollout(self, rec: StepRecord | None) -> None:
        """4. Generation goes on; trajectories the new version makes too stale are aborted now."""
        if not self.services.proxy.suspended:
            return
        with phases.phase(self._step_span, "resume"):
            self.services.proxy.resume()
        self.launcher.carry_out(self.buffer.enforce_staleness(self.published))
        self.launcher.wake()
        self._installed = True

    async def recompute_kv(self, rec: StepRecord | None) -> None:
        """5. Drop the engines' prefix caches: aborted turns re-prefill under the new weights."""
        if not self._installed:
            return
        self._installed = False
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "recompute-kv"):
            await self.services.proxy.reset_prefix_cache()
        self._sync["recompute_kv_s"] = time.perf_counter() - t0
        self.syncs.append(self._sync)
        if rec is not None:
            rec.phases.update({k: self._sync[k] for k in ("suspend_s", "update_s", "recompute_kv_s")})

    async def train(self, groups: list[Group], rec: StepRecord) -> None:
        """6. Submit the batch to the trainer, ordered after the publish of the version it starts from
        (the publish reads the weights this step changes). α = 0 waits for it and installs it."""
        with phases.phase(self._step_span, "train"):
            self.trained_ids += [t.id for g in groups for t in g.kept]
            self.counts["trained_without_reward"] += sum("reward" not in t.info for g in groups for t in g.kept)  # (never: scored only)
            advantage = advantage_fn(self.cfg.trainer.advantage, self.cfg.trainer.adv_scale)
            samples, rec.batch = build_samples(groups, advantage, digest=self.cfg.rollout.deterministic)  # (sha256: replayed?)
            self.metrics.samples(self.published, [g.kept[0] for g in groups[: self.cfg.observe.samples] if g.kept])
            stale = Counter(self.buffer.staleness(self.published, groups))  # trainer version at Train − start version
            rec.batch["staleness"] = {str(k): v for k, v in sorted(stale.items())}
            rec.batch.update(self.buffer.lag(self.published, groups, time.monotonic()))  # its two parts: in flight, in the queue
            batch_id = uuid.uuid4().hex  # resubmitted to a re-created trainer (recovery.py), it is answered by its id, not trained twice
            submit = lambda: self.recovery.submit_train(samples, after=self.services.weights.publishing, batch_id=batch_id)  # noqa: E731
            fut = await self.recovery.submit(submit)
        self._training = (fut, rec, submit, samples)
        if self.alpha == 0:  # on-policy: training and the weight update finish before rollout goes on
            await self.finish_training(write=False)
            await self._install_published(rec)
            self.metrics.write(rec.row())

    async def finish_training(self, write: bool = True) -> None:
        """Wait for the Train in flight; it publishes its version (engines start pulling it at once)."""
        if self._training is None:
            return
        (fut, rec, submit, samples), self._training = self._training, None
        s = self.services
        t0 = time.perf_counter()
        with phases.phase(self._step_span, "wait-train"):  # the publish's tasks (and the engines' pulls) nest here too
            metrics, fut = await self.recovery.result(submit, fut, 600, step=True)
            rec.phases["wait_train_s"] = time.perf_counter() - t0
            self.published = rec.version = int(metrics.pop("version"))
            self.recovery.trained(self.published, "train", tasks.trainer_step, samples)
            s.weights.publish(self.published, s.proxy.pool_of, after=fut)
        rec.train = metrics
        self.counts["samples_over_lag_dropped"] += metrics.get("samples_over_lag_dropped", 0)  # (0: Get Batch evicted them)
        self.telemetry.train_busy_s += metrics["train_s"]
        every = self.cfg.trainer.checkpoint_every
        if every and self.published % every == 0:
            await self.checkpoint(after=fut)
        self.status.progressed()
        if write:
            self.metrics.write(rec.row())

    async def _install_published(self, rec: StepRecord | None = None) -> None:
        """Steps 2–5 outside a step: after set-up's restore or warm start, for α = 0, and at the end."""
        await self.suspend(rec)
        await self.update_weights(rec)
        await self.resume_rollout(rec)
        await self.recompute_kv(rec)

    # -- evaluation ---------------------------------------------------------------------------------
    async def evaluate(self, seeds: range | None = None, tasks: list[TaskConfig] | None = None, temperature: float | None = None) -> dict:
        """Held-out evaluation at the engines' version on every task's held-out seeds (or ``seeds`` of ``tasks``), greedy or sampled
        at ``eval.temperature`` (or ``temperature``): an eval row; each task's outcomes by seed in ``self.outcomes``."""
        version, t0 = self.engine_version, time.monotonic()
        temperature = self.cfg.eval.temperature if temperature is None else temperature

        def seeds_of(task: TaskConfig, start=self.cfg.eval.start_seed) -> range:
            return seeds if seeds is not None else range(start, start + (task.eval_seeds or self.cfg.eval.seeds))

        with phases.phase(self._step_span, "eval"):
            if self.cfg.emulated:  # EMULATED: synthetic tokens, no policy to score
                out = {}
            else:
                chosen = {t.name: (t, seeds_of(t)) for t in tasks or self.cfg.tasks}
                tag = f"{self.run_id}-v{version}"
                out, self.outcomes = await evaluation.play_all(self.services.em, chosen, tag, version, temperature, self.cfg)
        row = {
            "kind": "eval",
            "step": version,
            "version": version,
            "eval": out,
            "temperature": temperature,
            "elapsed_s": time.monotonic() - self.status.t_start,
            "eval_s": time.monotonic() - t0,
        }
        self.history.append(row)
        self.metrics.write(row)
        return out

    # -- the whole run ------------------------------------------------------------------------------
    async def run(self, on_step=None) -> dict:
        """Run the flow to its end; returns first/last held-out evaluations and the counts."""
        with fewer_collections():  # thousands of trajectories in flight: see control/collector.py
            return await self._run(on_step)

    async def _run(self, on_step) -> dict:
        cfg = self.cfg
        self.status.started()  # set-up (model loads, warm start) is not a stall
        # one Dask span for the run: the first evaluation, rollout and every step nest in it
        self._run_span = self._step_span = phases.new_span("rollart")
        self.launcher.rollout_span = phases.new_span("rollout", parent=self._run_span)
        t = self.telemetry
        self._unwatch = self.recovery.watch_connection()  # (undone at stop: the client may be the user's)
        joins = membership.watch(self.services, self.status, self.recovery, self.elastic, lambda: self.launcher.stopping)
        self._bg = stopping.background(
            self, {"launcher": self.launcher.loop(), "watchdog": t.watchdog(), "membership": joins, "feed": t.feed()}
        )
        notify = on_step or (lambda run: None)
        try:
            await self.evaluate()
            notify(self)
            await t.start()
            for number in range(1, cfg.trainer.steps + 1):
                if not await self.step(number):
                    break
                if self.placement is not None:  # affinity auto: the mapping is chosen (and applied) at a step boundary
                    await self.placement.after_step(number, self.metrics.write)
                if cfg.eval.every and self.engine_version % cfg.eval.every == 0 and self.engine_version > self.history[-1]["version"]:
                    await self.evaluate()
                notify(self)
            await self.finish_training()  # the last Train publishes; its version reaches the engines
            await self._install_published()  # (also when a stop ended the loop)
            if self.history[-1]["version"] != self.engine_version:
                await self.evaluate()
            notify(self)
            self.final_checkpoint = await self.checkpoint(final=True)
            return stopping.ended(self)
        except Exception as e:  # stopped on an error: what the run has is still written (the entry point's summary.json)
            e.partial = await stopping.stopped_with(self, e)
            raise
        finally:
            await self.stop()

    def accounting(self) -> dict:  # launched trajectories by outcome (SampleBuffer.account), and what would mean a sample lost or made up
        return {
            **self.buffer.account(),
            "trained_twice": len(self.trained_ids) - len(set(self.trained_ids)),
            "trained_without_reward": self.counts["trained_without_reward"],
        }

    async def checkpoint(self, after=None, final: bool = False) -> str | None:
        """An HF checkpoint of the trainer at the run's version (ordered after the Train future ``after``): recovery.py."""
        return await self.recovery.checkpoint(self.out / "checkpoints", self.published, after, final)

    async def stop(self) -> None:
        """Idempotent: the entry point calls it again after a failed set-up or run."""
        if self.stopped:
            return
        self.stopped = True
        if self._bg and not self.launcher.stopping:  # the page shows the run's end, not its last second
            await self.telemetry.publish(final=True)
        await self.recovery.stop()
        self._unwatch()
        for task in [*self._bg, *self.elastic.joining]:
            task.cancel()
        if self.launcher is not None:
            await self.launcher.stop()
        await asyncio.gather(*self._bg, *self.elastic.joining, return_exceptions=True)
        if self.services is not None:  # the cancelled trajectories' envs are closed before the channels shut
            left = await self.services.em.closes_done(timeout=2 * self.cfg.rollout.env_timeout_s)  # (one may wait out a hung call)
            if left:
                console.print(
                    f"[yellow]{left} env closes got no answer within rollout.env_timeout_s "
                    f"({self.cfg.rollout.env_timeout_s:.0f} s): their envs may outlive the run[/yellow]"
                )
        try:
            self.metrics.close(self.final_checkpoint)
            self.d.close()
            if self.services is not None:
                await asyncio.to_thread(self.services.rewards.close)
        finally:
            if self._weights is not None:  # never leave a mooncake_master behind
                await self._weights.close()
