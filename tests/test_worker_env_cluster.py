"""The embedded cluster's workers keep glibc's malloc at its defaults: dask's MALLOC_TRIM_THRESHOLD_ (set before a
Nanny spawns its worker) made every large torch allocation an mmap, 1.3–1.7× slower generation and training. And their
OpenMP threads wait passively (they share the cores with other busy workers) unless the environment says otherwise."""

import os

import pytest
from distributed import Client, SpecCluster

from rollart_dask.config import ClusterConfig, WorkerSpec
from rollart_dask.resource.cluster import MALLOC_TRIM, OMP_WAIT, cluster_spec


def worker_sees(monkeypatch, value: str | None, name: str = MALLOC_TRIM) -> list:
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    spec = cluster_spec(ClusterConfig(workers=[WorkerSpec(name="w", pools=["CPU"], nthreads=1)]))
    with SpecCluster(workers=spec["workers"], scheduler=spec["scheduler"], silence_logs=40) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=60)
        return list(client.run(lambda: os.environ.get(name)).values())


@pytest.mark.parametrize("given, seen", [(None, None), ("65536", None), ("131072", "131072")])  # 65536: dask's own, left behind
def test_a_pool_worker_gets_no_trim_threshold_but_one_the_environment_sets(monkeypatch, given, seen):
    assert worker_sees(monkeypatch, given) == [seen]


@pytest.mark.parametrize("given, seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_pool_workers_openmp_threads_wait_passively_unless_the_environment_says(monkeypatch, given, seen):
    assert worker_sees(monkeypatch, given, OMP_WAIT) == [seen]
