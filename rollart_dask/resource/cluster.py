"""The embedded local heterogeneous cluster (SpecCluster of Nanny workers tagged by pool, the
scheduler in a process of its own), or a connection to an existing scheduler. Loopback only unless
``cluster.listen`` exposes it, and then TLS (resource/security.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import dask
from distributed import Client, Nanny, SpecCluster

from rollart_dask import compat
from rollart_dask.config import ClusterConfig
from rollart_dask.observe import console
from rollart_dask.resource.pools import worker_resources
from rollart_dask.resource.security import attach_security, embedded_security, host_of, is_loopback, scheduler_env


SYSTEM_MONITOR = "distributed.admin.system-monitor.interval"
NANNY_MONITOR_INTERVAL = "10s"


# the scheduler's Active Memory Manager drops the extra replicas of a key, first those on the worker using the most memory:
# the trainer's. A published version (manifest, buckets) was then held by one engine alone and lost with it, and the next
# Train and a joining engine's stage were "already forgotten". Off on the embedded cluster; stopped on an attached one.
AMM_OFF = {"DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False"}


async def keep_replicas(client) -> bool:
    """Stop the scheduler's Active Memory Manager (see AMM_OFF); True when it was running."""
    if not await client.scheduler.amm_handler(method="running"):
        return False
    await client.scheduler.amm_handler(method="stop")
    return True


async def cluster_state(client) -> dict:
    """What a run changes on a cluster it attaches to: the plugins registered (scheduler, worker, nanny) and whether
    the Active Memory Manager runs."""
    return {**await client.run_on_scheduler(compat.plugin_names), "amm": bool(await client.scheduler.amm_handler(method="running"))}


KEPT_PLUGINS = ("rollart-dashboard",)  # the RollArt page: it holds only what it shows, the finished runs' record


async def leave_as_found(client, found: dict) -> None:
    """Undo what the run changed since ``found`` (cluster_state): its plugins (named rollart-…, but the dashboard page's)
    unregistered, their teardown freeing the models and envs they hold, and the Active Memory Manager restarted if it
    ran. A step that fails is said, and the others still run: the run's result stands."""
    try:
        now = await cluster_state(client)
    except Exception as e:
        console.print(f"[yellow]could not read the cluster's plugins to leave it as found ({type(e).__name__}: {e})[/yellow]")
        return
    undo = [
        (f"{kind} plugin {name}", kind, name)
        for kind in ("worker", "nanny", "scheduler")
        for name in sorted(set(now[kind]) - set(found[kind]))
        if name.startswith("rollart-") and name not in KEPT_PLUGINS
    ]
    for what, kind, name in undo:
        try:
            if kind == "scheduler":
                await client.unregister_scheduler_plugin(name)
            else:
                await client.unregister_worker_plugin(name, nanny=kind == "nanny")
        except Exception as e:
            console.print(f"[yellow]could not unregister the {what} ({type(e).__name__}: {e})[/yellow]")
    if found["amm"] and not now["amm"]:
        await client.scheduler.amm_handler(method="start")
        console.print("restarted the scheduler's Active Memory Manager (the run had stopped it)")


PRELOAD = "rollart_dask.serve.dashboard.preload"
MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"
OMP_WAIT = "OMP_WAIT_POLICY"


class PoolNanny(Nanny):
    """A Nanny whose worker keeps glibc's malloc at its defaults. Dask sets ``MALLOC_TRIM_THRESHOLD_=65536`` before it
    spawns a worker (``distributed.nanny.pre-spawn-environ``), which also turns off glibc's dynamic mmap threshold: every
    large torch tensor is then a fresh mmap, faulted in and zeroed at each allocation. Measured on a 2-core box
    (benchmarks/engine_trainer_speed.py, SmolLM2-135M, one thread): generation 63 → 98 tok/s and the trainer's update
    19.8 → 11.5–18.7 s without it. Another value in this process's environment is kept (it is the user's); dask's own
    there was left by a plain Nanny spawned before (it writes its pre-spawn variables into this process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dasks = dask.config.get("distributed.nanny.pre-spawn-environ", {}).get(MALLOC_TRIM)
        if os.environ.get(MALLOC_TRIM) in (None, str(dasks)):
            os.environ.pop(MALLOC_TRIM, None)  # (the spawned worker inherits this process's environment)
            self.pre_spawn_env.pop(MALLOC_TRIM, None)
            self.env.pop(MALLOC_TRIM, None)


def cluster_spec(cfg: ClusterConfig, security=None) -> dict:
    """Every server binds ``cfg.listen`` (the workers' HTTP servers too); ``security``: TLS, else plain TCP."""
    host = f"[{cfg.listen}]" if ":" in cfg.listen else cfg.listen
    # the Mooncake transfer engine (store=mooncake) advertises this address to its peers (it still listens on every
    # interface: its TCP transport has no bind option; the run says so at start)
    bind_env = {"MC_TCP_BIND_ADDRESS": cfg.listen} if is_loopback(cfg.listen) else {}
    workers = {}
    for w in cfg.workers:
        workers[w.name] = {
            "cls": PoolNanny,
            "options": {
                "host": cfg.listen,
                "dashboard_address": f"{host}:0",
                "security": security,
                "nthreads": w.nthreads,
                "resources": worker_resources(list(w.pools)),
                "env": {
                    **bind_env,
                    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
                    "OMP_NUM_THREADS": str(w.torch_threads),
                    "MKL_NUM_THREADS": str(w.torch_threads),
                    # workers share the machine's cores: OpenMP threads that spin while they wait collapse beside another
                    # busy worker (a 2-thread trainer beside a generating engine), so they wait passively unless set
                    OMP_WAIT: os.environ.get(OMP_WAIT, "PASSIVE"),
                    "TOKENIZERS_PARALLELISM": "false",
                },
                "memory_limit": 0,
                "name": w.name,
                # the worker samples its process as usual (the dashboard's CPU and memory); only its Nanny, which
                # lives in the client's process, samples rarely (see start_local_cluster)
                "config": {SYSTEM_MONITOR: dask.config.get(SYSTEM_MONITOR)},
            },
        }
    kwargs = {
        "host": cfg.listen,
        "protocol": "tls" if security else "tcp",
        "dashboard_address": cfg.dashboard_address,
        "preload": [PRELOAD],
    }  # the RollArt page listed in JupyterLab's Dask extension
    scheduler = {"cls": SchedulerProcess, "options": {"scheduler_kwargs": kwargs, "env": {**scheduler_env(security), **AMM_OFF}}}
    return {"workers": workers, "scheduler": scheduler, "security": security}


# Run as `python -c`: the child asks Linux for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), so a client killed
# even by SIGKILL leaves no scheduler behind; then it runs the module it was given as `python -m` would.
_DIE_WITH_PARENT = """import os, runpy, signal, sys
parent = int(sys.argv.pop(1))
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took hold
        sys.exit(0)
module = sys.argv.pop(1)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def dies_with_this_process(module: str, *args: str) -> list[str]:
    """The argv of ``python -m module args…`` in a child that ends when this process does (on Linux)."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), module, *args]


class SchedulerProcess(compat.SchedulerSubprocess):
    """The embedded scheduler in its own process, not in the client's: there it would share the client's
    event loop and GIL with every trajectory coroutine, and every message between them would be
    serialised and parsed twice in one process. Its output goes to ``log_path`` (distributed's own
    SubprocessScheduler pipes it and never reads the pipe, which a scheduler that logs would fill).
    ``env``: what this process alone is given (its TLS configuration)."""

    def __init__(self, scheduler_kwargs: dict | None = None, env: dict | None = None, timeout: int = 30):
        super().__init__(scheduler_kwargs, timeout)
        self.extra_env = dict(env or {})

    async def _start(self):
        fd, self.log_path = tempfile.mkstemp(prefix="rollart-scheduler-", suffix=".log")
        spec = json.dumps({"cls": "distributed.Scheduler", "opts": self.scheduler_kwargs})
        # the client's sys.path, as multiprocessing gives the Nanny workers: functions the client sends the
        # scheduler (run_on_scheduler, plugins) unpickle by reference to modules it imported
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **self.extra_env)
        with os.fdopen(fd, "wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                *dies_with_this_process("dask", "spec", "--spec", spec), stdout=log, stderr=log, env=env
            )
        scheduler_file = Path(self.scheduler_kwargs["scheduler_file"])
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.process.returncode is None:
            try:
                self.address = json.loads(scheduler_file.read_text())["address"]
                return
            except (OSError, json.JSONDecodeError, KeyError):  # not written yet, or half-written
                await asyncio.sleep(0.05)
        why = f"exited with code {self.process.returncode}" if self.process.returncode is not None else f"did not start in {self.timeout}s"
        raise RuntimeError(f"the embedded scheduler {why}; its log: {self.log_path}:\n{Path(self.log_path).read_text()[-2000:]}")

    async def close(self):
        await super().close()
        Path(self.scheduler_kwargs["scheduler_file"]).unlink(missing_ok=True)


class EmbeddedCluster(SpecCluster):
    """The dashboard is bound apart from the cluster (cluster.dashboard_address): its link names its own host,
    not the scheduler's (an exposed scheduler with a loopback dashboard)."""

    dashboard_host: str = ""

    @property
    def dashboard_link(self):
        link = super().dashboard_link
        if link and self.dashboard_host and not self.dashboard_host.startswith("0.0.0.0") and self.dashboard_host != "::":
            scheduler_host = self.scheduler_address.split("://")[1].split("/")[0].split(":")[0]
            link = link.replace(f"//{scheduler_host}:", f"//{self.dashboard_host}:", 1)
        return link


def quiet_worker_logs() -> None:
    """Workers' INFO chatter (every client.run, every plugin start and close) drowns a run's output: errors only,
    unless DASK_LOGGING__DISTRIBUTED says otherwise (workers started after this inherit it)."""
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    dask.config.set({"logging.distributed": os.environ["DASK_LOGGING__DISTRIBUTED"]})


async def start_local_cluster(cfg: ClusterConfig, silence_logs=logging.ERROR) -> SpecCluster:
    quiet_worker_logs()
    spec = cluster_spec(cfg, embedded_security(cfg))
    # Every Nanny is a Server in the client's process, each sampling the machine with psutil twice a second for
    # nothing it shows (a few % of the client's core): once every 10 s there.
    with dask.config.set({SYSTEM_MONITOR: NANNY_MONITOR_INTERVAL}):
        cluster = EmbeddedCluster(
            workers=spec["workers"],
            scheduler=spec["scheduler"],
            asynchronous=True,
            silence_logs=silence_logs,
            name="rollart",
            security=spec["security"],
        )
        cluster.dashboard_host = host_of(cfg.dashboard_address)
        await cluster
    return cluster


async def connect(cfg: ClusterConfig, security=None):
    """Return (client, cluster or None). Embedded cluster when no scheduler address is set; ``security``
    (a distributed Security, e.g. an attaching client's) overrides the flow's for an existing scheduler."""
    if cfg.scheduler:
        client = await Client(cfg.scheduler, asynchronous=True, security=attach_security(cfg, security))
        return client, None
    cluster = await start_local_cluster(cfg)
    client = await Client(cluster, asynchronous=True)
    await client.wait_for_workers(len(cfg.workers), timeout=120)
    return client, cluster
