"""The embedded local heterogeneous cluster (SpecCluster of Nanny workers tagged by pool),
or a connection to an existing scheduler."""
from __future__ import annotations

import logging
import os

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from rollart_dask.config import ClusterConfig
from rollart_dask.resource.pools import worker_resources


def cluster_spec(cfg: ClusterConfig) -> dict:
    workers = {}
    for w in cfg.workers:
        workers[w.name] = {
            "cls": Nanny,
            "options": {
                "nthreads": w.nthreads,
                "resources": worker_resources(list(w.pools)),
                "env": {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False", "OMP_NUM_THREADS": str(w.torch_threads), "MKL_NUM_THREADS": str(w.torch_threads), "TOKENIZERS_PARALLELISM": "false"},
                "memory_limit": 0,
                "name": w.name,
            },
        }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": cfg.dashboard_address}}
    return {"workers": workers, "scheduler": scheduler}


async def start_local_cluster(cfg: ClusterConfig, silence_logs=logging.ERROR) -> SpecCluster:
    # Workers' INFO chatter (every client.run, every start/close) drowns a run's output.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    dask.config.set({"logging.distributed": os.environ["DASK_LOGGING__DISTRIBUTED"]})
    spec = cluster_spec(cfg)
    cluster = await SpecCluster(workers=spec["workers"], scheduler=spec["scheduler"], asynchronous=True, silence_logs=silence_logs, name="rollart")
    return cluster


async def connect(cfg: ClusterConfig):
    """Return (client, cluster or None). Embedded cluster when no scheduler address is set."""
    if cfg.scheduler:
        client = await Client(cfg.scheduler, asynchronous=True)
        return client, None
    cluster = await start_local_cluster(cfg)
    client = await Client(cluster, asynchronous=True)
    await client.wait_for_workers(len(cfg.workers), timeout=120)
    return client, cluster
