"""Resource plane: the only place that turns a pool into Dask submit arguments.

Pools are Dask worker resources used as tags with a large capacity; concurrency is decided
by the services (an engine batches what it holds, an env host runs many envs), not by
resource counts. A run validates the cluster before its first submit: a pool without a
worker is an error naming the pool and the workers seen, never a task stuck in no-worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# The one pool vocabulary: the flow schema (config/schema.py) types its fields with these, nothing else defines them.
Pool = Literal["H800", "H20", "CPU", "SERVERLESS", "TRAIN", "REWARD"]
EnginePool = Literal["H800", "H20"]
POOLS: tuple[str, ...] = get_args(Pool)
ENGINE_POOLS: tuple[str, ...] = get_args(EnginePool)
# reward.mode picks the reward pool: serverless → SERVERLESS (boto3 callers), local → REWARD (a dedicated worker)
REWARD_POOL = {"serverless": "SERVERLESS", "local": "REWARD"}
# a task's affinity → the engine pool its generation goes to (any: any engine pool; auto is placed as one of these by the run)
AFFINITY_POOL: dict[str, str | None] = {"prefill": "H800", "decode": "H20", "any": None}
TAG_CAPACITY = 1_000_000


class PoolError(RuntimeError):
    pass


def worker_resources(pools: list[str]) -> dict[str, float]:
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        raise PoolError(f"unknown pool(s) {unknown}; pools are {', '.join(POOLS)}")
    return {p: TAG_CAPACITY for p in pools}


def submit_kwargs(pool: str, worker: str | None = None, key: str | tuple | None = None) -> dict:
    """Dask submit arguments for a task of ``pool`` (optionally pinned to one worker of it)."""
    if pool not in POOLS:
        raise PoolError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
    kw: dict = {"resources": {pool: 1}, "pure": False}
    if worker is not None:
        kw["workers"] = [worker]
        kw["allow_other_workers"] = False
    if key is not None:
        kw["key"] = key
    return kw


@dataclass
class PoolMap:
    """Which workers serve which pool, from a scheduler snapshot."""

    workers: dict[str, dict] = field(default_factory=dict)  # address → {"name":…, "resources":…}

    @classmethod
    def from_scheduler_info(cls, info: dict) -> "PoolMap":
        return cls(
            {
                addr: {"name": w.get("name", addr), "resources": dict(w.get("resources", {})), "nthreads": int(w.get("nthreads", 1))}
                for addr, w in info["workers"].items()
            }
        )

    def members(self, pool: str) -> list[str]:
        return sorted(a for a, w in self.workers.items() if pool in w["resources"])

    def engine_workers(self, pool: str) -> list[str]:
        """Engines live on the pool's workers, never in the trainer's or the dedicated reward worker's process."""
        return [a for a in self.members(pool) if not {"TRAIN", "REWARD"} & set(self.workers[a]["resources"])]

    def name(self, address: str) -> str:
        return str(self.workers.get(address, {}).get("name", address))

    def describe(self) -> str:
        return ", ".join(f"{w['name']}[{'+'.join(sorted(w['resources'])) or 'no pools'}]" for w in self.workers.values()) or "no workers"

    def validate(self, needed: dict[str, str]) -> None:
        """``needed``: pool → why the flow needs it. Raises PoolError naming every missing pool."""
        missing = []
        for pool, why in needed.items():
            found = self.engine_workers(pool) if why.startswith("engine") else self.members(pool)
            if not found:
                missing.append(f"pool {pool} ({why}) has no worker")
        if missing:
            raise PoolError("cluster cannot run this flow: " + "; ".join(missing) + f". Workers seen: {self.describe()}")
