"""Service wiring, before a run's first step: the resource plane checks the cluster, the data plane's
services go onto their workers (plugins), and the control plane's proxy and env manager are built
around them. Also the two ways a run can start from weights other than the model's own: a restored
checkpoint and an imitation warm start (both publish a version the run then installs).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rollart_dask import compat
from rollart_dask.config import FlowConfig, check_pd_backend, resolve_engine_backend
from rollart_dask.control import preflight
from rollart_dask.control.dispatch import Dispatcher
from rollart_dask.control.envmanager import EnvManager
from rollart_dask.control.proxy import LLMProxy
from rollart_dask.control.reward_plane import RewardPlane
from rollart_dask.data import plugins, tasks
from rollart_dask.data.weights.store import WeightStore
from rollart_dask.observe import MetricsWriter, console
from rollart_dask.resource.check import engine_pools, needed_pools
from rollart_dask.resource.cluster import keep_replicas
from rollart_dask.resource.pools import PoolMap


@dataclass
class Services:
    """What a run talks to: the cluster's pools and the services placed on them."""

    client: object
    d: Dispatcher
    poolmap: PoolMap
    trainer: str  # the trainer worker's address
    weights: WeightStore
    rewards: RewardPlane
    proxy: LLMProxy
    em: EnvManager
    engine_backend: str
    layout: dict[str, list[str]]  # engine pool → its engine workers' names
    preflight: dict | None = None  # each task's pre-flight episode: its turns and reward (control/preflight.py)


async def wire(
    cfg: FlowConfig,
    client,
    out: Path,
    model_dir: Path | None,
    d: Dispatcher,
    start_endpoint: Callable | None = None,
    on_weights: Callable[[WeightStore], None] | None = None,
    until_preflight: bool = False,
) -> Services:
    """Check the cluster and start every service; ``on_weights`` sees the weight store as soon as it
    exists, so a failure later in set-up can still close it (a local mooncake_master). ``until_preflight``: stop after
    the pre-flight (control/preflight.py), before any model loads (`rollart check`)."""
    compat.check(dashboard=False)  # a distributed without one of the private hooks this run needs fails here, naming it
    backend = resolve_engine_backend(cfg.engine)
    if cfg.rollout.pd:  # engine.backend auto resolves only now: vllm cannot disaggregate here
        check_pd_backend(backend)
    if await keep_replicas(client):
        console.print(
            "stopped the scheduler's Active Memory Manager: it drops the trainer's copy of published weights, "
            "leaving them on an engine that may leave"
        )
    poolmap = PoolMap.from_scheduler_info(await client.scheduler.identity())
    poolmap.validate(needed_pools(cfg))
    trainer = poolmap.members("TRAIN")[0]
    weights = WeightStore(cfg.weights, d, trainer, out)
    if on_weights is not None:
        on_weights(weights)
    await weights.start()  # weights.store=mooncake on the embedded default: a local mooncake_master
    pools = engine_pools(cfg, poolmap)
    engines = {p: poolmap.engine_workers(p) for p in pools}
    for name, plugin in plugins.user_code(cfg.imports):  # first: the services below may name what they declare
        await client.register_plugin(plugin, name=name)
    await client.register_plugin(plugins.EnvHostPlugin(["CPU"], threads=cfg.cluster.env_threads), name=plugins.ENVHOST)
    rewards = RewardPlane(cfg, out, start_endpoint)
    reward_spec = await rewards.start()
    await client.register_plugin(plugins.RewardPlugin([rewards.pool], **reward_spec), name=plugins.REWARD)
    # the emulated and null engines batch continuously across calls: each request is answered alone (a real engine runs
    # one batch per call)
    proxy = LLMProxy(
        d,
        engines,
        timeout_s=cfg.rollout.generate_timeout_s,
        streamed=cfg.emulated,
        pd=cfg.rollout.pd_route,  # (auto: off until the placement decides)
        partial=cfg.rollout.partial,
        wait_s=cfg.rollout.worker_wait_s,
    )
    em = EnvManager(
        d,
        proxy,
        poolmap.members("CPU"),
        cfg.rollout,
        cfg.engine,
        reward_pool=rewards.pool,
        reward_functions=rewards.functions,
        stateful_rewards=rewards.kept_local,
        reward_workers={p: poolmap.members(p) for p in {rewards.pool, "REWARD"}},
    )
    layout = {p: [poolmap.name(a) for a in addrs] for p, addrs in engines.items()}
    services = Services(client, d, poolmap, trainer, weights, rewards, proxy, em, backend, layout)
    if cfg.rollout.preflight and not cfg.emulated:  # the user's envs and rewards, before the models load and anything generates
        services.preflight = await preflight.check(cfg, services)
    if until_preflight:
        return services
    await client.register_plugin(plugins.engine_plugin(cfg, pools, str(model_dir), backend), name=plugins.ENGINE)
    await client.register_plugin(plugins.trainer_plugin(cfg, str(model_dir)), name=plugins.TRAINER)
    return services


async def restore(s: Services, out: Path, checkpoint: Path | None = None) -> tuple[str, int]:
    """The run's latest checkpoint (or ``checkpoint``), loaded into the trainer and published: its path and version."""
    latest = out / "checkpoints" / "latest"
    if checkpoint is None and not latest.exists():
        raise FileNotFoundError(f"--resume: no checkpoint under {latest.parent}")
    path = str(Path(checkpoint).resolve()) if checkpoint is not None else latest.read_text().strip()
    if not path or not Path(path).is_dir():  # (an empty pointer would restore from the current directory)
        raise FileNotFoundError(
            f"--resume: {latest if checkpoint is None else 'the checkpoint'} names {path!r}, which is not a "
            "checkpoint directory (rewrite it with the path of one of the run's checkpoints/step-N)"
        )
    fut = s.d.submit_one("restore", tasks.trainer_restore, path, pool="TRAIN", worker=s.trainer)
    version = await fut
    s.weights.publish(version, s.proxy.pool_of, after=fut, setup=True)
    console.print(f"{'resumed' if checkpoint is None else 'loaded'} from {path} at version {version}")
    return path, version


async def warm_start(s: Services, cfg: FlowConfig, metrics: MetricsWriter, record: Callable | None = None) -> int:
    """Imitate each task's expert before RL (demonstrations played on the env workers, SFT on the
    trainer) and publish the result: the first held-out evaluation then measures the warm-started
    policy, so it is never counted as RL gain. Returns the published version; ``record`` is given the trainer call
    (version, stage, function, arguments), to be replayed on a re-created trainer (control/recovery.py)."""
    ws, t0 = cfg.warmstart, time.monotonic()
    tasks_by_name = {t.name: t for t in cfg.tasks}
    names = ws.tasks or list(tasks_by_name)
    cpu = s.poolmap.members("CPU")
    rng = random.Random(cfg.seed + 1)  # training seeds only: held-out seeds lie at eval.start_seed and above
    futs = []
    for i, name in enumerate(names):
        t = tasks_by_name[name]
        item = {
            "task": name,
            "env": t.env,
            "env_args": t.env_args,
            "max_turns": t.max_turns,
            "max_tokens": t.max_tokens,
            "prompt": t.prompt.model_dump(),
            "seeds": [rng.randrange(0, cfg.eval.start_seed) for _ in range(ws.episodes)],
        }
        futs.append(s.d.submit_one("warmstart-demos", tasks.env_expert_demos, item, pool="CPU", worker=cpu[i % len(cpu)]))
    demos = [d for batch in await asyncio.gather(*futs) for d in batch]
    args = (demos, ws.steps, ws.batch, ws.lr, cfg.seed, ws.tasks)
    fut = s.d.submit_one("warmstart", tasks.trainer_warm_start, *args, pool="TRAIN", worker=s.trainer)
    m = await fut
    version = int(m.pop("version"))
    if record is not None:
        record(version, "warmstart", tasks.trainer_warm_start, *args)
    s.weights.publish(version, s.proxy.pool_of, after=fut, setup=True)
    per_task = Counter(d["task"] for d in demos)
    row = {
        "kind": "warmstart",
        "step": version,
        "version": version,
        "turns_per_task": dict(per_task),
        "elapsed_s": time.monotonic() - t0,
        **m,
    }
    metrics.write(row)
    console.print(
        f"warm start: {m['steps']} imitation steps on {m['samples']} expert turns ({dict(per_task)}; {m['skipped']} did not fit "
        f"the decoding) in {row['elapsed_s']:.0f}s, NLL {m['nll_first']:.3f} → {m['nll_last']:.3f}; "
        f"held-out scores below start from this policy"
    )
    return version
