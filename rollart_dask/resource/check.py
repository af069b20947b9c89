"""`rollart cluster check`: which pools a running cluster offers, and whether a flow can run there.

Pure functions of a scheduler snapshot (``client.scheduler.identity()``) and a flow, so they are
tested without a cluster. The rules are the run's own (``needed_pools``, ``engine_pools``,
``PoolMap.validate``), so a cluster a run's set-up rejects fails here too; the check also names
what a run finds only later (affinity-auto tasks with no engine worker, stateful rewards with no
REWARD worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollart_dask.config import FlowConfig, task_pool
from rollart_dask.resource.pools import ENGINE_POOLS, POOLS, REWARD_POOL, PoolMap

ANY_ENGINE = " or ".join(ENGINE_POOLS)  # the row of affinity-auto tasks when no engine pool has a worker


@dataclass
class PoolRow:
    pool: str
    workers: list[tuple[str, str, int]] = field(default_factory=list)  # (name, address, nthreads)
    need: str | None = None  # why the flow needs this pool; None: not needed (or no flow given)
    ok: bool | None = None  # None when the flow does not need the pool


def needed_pools(cfg: FlowConfig) -> dict[str, str]:
    """Pool → why a run of ``cfg`` needs it (what a run's set-up validates before its first submit)."""
    need = {"TRAIN": "trainer", "CPU": "env hosts", REWARD_POOL[cfg.reward.mode]: f"reward ({cfg.reward.mode})"}
    for t in cfg.tasks:
        pool = task_pool(t)
        if pool:
            need[pool] = f"engine for task {t.name} (affinity {t.affinity})"
    if cfg.rollout.pd == "auto":  # any direction may be chosen
        need.update({p: "engine for rollout.pd auto" for p in ENGINE_POOLS})
    elif cfg.rollout.pd:  # disaggregated: every generate call prefills on one pool and decodes on the other
        need.update({cfg.rollout.pd.prefill: "engine for rollout.pd.prefill", cfg.rollout.pd.decode: "engine for rollout.pd.decode"})
    return need


def engine_pools(cfg: FlowConfig, poolmap: PoolMap) -> list[str]:
    """The pools whose workers get an engine."""
    if cfg.rollout.pd == "auto":
        return sorted(ENGINE_POOLS)
    if cfg.rollout.pd:  # disaggregated: the engines of both phases, whatever the tasks' affinity
        return sorted({cfg.rollout.pd.prefill, cfg.rollout.pd.decode})
    pools = {task_pool(t) for t in cfg.tasks}
    if None in pools:  # affinity any (or auto, not placed yet): every engine pool that has workers
        pools.discard(None)
        pools |= {p for p in ENGINE_POOLS if poolmap.engine_workers(p)}
    return sorted(pools)


def flow_needs(cfg: FlowConfig, poolmap: PoolMap) -> dict[str, str]:
    """Pool → why ``cfg`` needs it on this cluster (the run's own rules, plus what set-up finds later)."""
    need = needed_pools(cfg)
    auto = [t.name for t in cfg.tasks if task_pool(t) is None]
    if auto:  # affinity any/auto: every engine pool with an engine worker serves, and at least one must
        why = f"engine for task {', '.join(auto)} (affinity {'/'.join(sorted({t.affinity for t in cfg.tasks if t.name in auto}))})"
        for pool in engine_pools(cfg, poolmap) or [ANY_ENGINE]:
            need.setdefault(pool, why)
    stateful = _stateful_rewards(cfg)
    if stateful:  # stateful rewards (LLM judge) stay on the REWARD pool in either reward mode
        need.setdefault("REWARD", f"stateful reward {', '.join(stateful)}")
    return need


def _stateful_rewards(cfg: FlowConfig) -> list[str]:
    from rollart_dask.registry import stateful_reward

    found = []
    for reward in sorted({t.reward for t in cfg.tasks}):
        try:
            if stateful_reward(reward) is not None:
                found.append(reward)
        except (ImportError, KeyError, AttributeError, TypeError):
            pass  # not importable here: the run itself reports it
    return found


def _served(poolmap: PoolMap, pool: str, why: str) -> list[str]:
    if pool == ANY_ENGINE:
        return [a for p in ENGINE_POOLS for a in poolmap.engine_workers(p)]
    # engines never live in the trainer's or the reward worker's process (PoolMap.engine_workers)
    return poolmap.engine_workers(pool) if why.startswith("engine") else poolmap.members(pool)


def check_cluster(info: dict, cfg: FlowConfig | None = None) -> tuple[list[PoolRow], list[str]]:
    """Rows for every pool seen or needed (known pools first, then unknown tags such as a mistyped
    ``h800``), and the problems that stop ``cfg`` from running here (empty: it can run)."""
    poolmap = PoolMap.from_scheduler_info(info)
    seen = {r for w in poolmap.workers.values() for r in w["resources"]}
    need = flow_needs(cfg, poolmap) if cfg is not None else {}
    names = [p for p in POOLS if p in seen or p in need] + sorted(seen - set(POOLS)) + [p for p in need if p not in POOLS]
    rows, problems = [], []
    for pool in names:
        members = [] if pool == ANY_ENGINE else poolmap.members(pool)
        row = PoolRow(pool, sorted((poolmap.name(a), a, int(info["workers"][a].get("nthreads", 0))) for a in members))
        if pool in need:
            row.need = need[pool]
            row.ok = bool(_served(poolmap, pool, row.need))
            if not row.ok:
                extra = " (its workers host the trainer or rewards, never an engine)" if members else ""
                problems.append(f"pool {pool} ({row.need}) has no worker{extra}")
        rows.append(row)
    return rows, problems


def pools_table(rows: list[PoolRow], title: str):
    """One line per (pool, worker); the flow's columns only when a flow was checked."""
    from rich.table import Table

    flow = any(r.need for r in rows)
    table = Table(title=title)
    for col in ("pool", "worker", "address", "threads") + (("flow needs it for", "status") if flow else ()):
        table.add_column(col, style="bold" if col == "pool" else None)
    for r in rows:
        status = "" if r.ok is None else ("[green]OK[/green]" if r.ok else "[red]MISSING[/red]")
        for i, (name, address, nthreads) in enumerate(r.workers or [("-", "", "")]):
            cells = [r.pool, name, address, str(nthreads)] if i == 0 else ["", name, address, str(nthreads)]
            table.add_row(*cells, *((r.need or "-", status) if flow and i == 0 else ("", "") if flow else ()))
    return table
