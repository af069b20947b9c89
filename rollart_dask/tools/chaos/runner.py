"""Running the chaos suite: each scenario a fresh run of the flow on the embedded default, its faults fired
on a seeded schedule (faults.py), then the proof that nothing was lost — every launched trajectory in one
outcome, none trained twice or without its reward, every batch full — and that nothing leaked: every env
the runtime made closed exactly once, no sandbox process or container left behind.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from rollart_dask.config import FlowConfig, load_flow
from rollart_dask.tools.chaos.faults import Injector
from rollart_dask.tools.chaos.scenarios import Scenario

TINY = ("trainer.steps=10", "rollout.batch_groups=8", "eval.every=0", "eval.seeds=10", "observe.progress=false", "trainer.max_minutes=null")


def scenario_flow(base: FlowConfig, scenario: Scenario, budget: tuple[str, ...]) -> FlowConfig:
    data = copy.deepcopy(base.model_dump(mode="json"))
    for extra in scenario.extra_workers:
        name, pools = extra.split(":", 1)
        data["cluster"]["workers"].append({"name": name, "pools": pools.split(","), "nthreads": 2})
    cfg = load_flow(data=data, overrides=[*budget, *scenario.overrides])
    cfg.trainer.steps = max(cfg.trainer.steps, scenario.min_steps)
    return cfg


# -- what leaks ---------------------------------------------------------------------------------------
def sandbox_processes() -> int:
    """Code-sandbox processes on this machine (their jail script on the command line)."""
    from rollart_dask.envs.code_sandbox.sandbox import JAIL

    n = 0
    for p in psutil.process_iter(["cmdline"]):
        if str(JAIL) in " ".join(p.info["cmdline"] or []):
            n += 1
    return n


def sandbox_containers() -> int | None:
    """Containers of the code-sandbox image, running or not; None without a Docker engine."""
    from rollart_dask.envs.code_sandbox.sandbox import DEFAULT_IMAGE, docker_client

    client = docker_client(timeout=3)
    if client is None:
        return None
    return len(client.containers.list(all=True, filters={"ancestor": DEFAULT_IMAGE}))


def _env_host_counts(dask_worker=None) -> dict:
    plugin = dask_worker.plugins.get("rollart-envhost")
    service = getattr(plugin, "service", None)
    if service is None:
        return {}
    return {"envs_made": service.stats["envs_made"], "envs_closed": service.stats["envs_closed"], "open": service.open_envs()}


async def env_hosts(run, settle_s: float = 10.0) -> dict:
    """Summed over the env workers alive once the run has stopped (a lost worker's envs went with its process). A
    close that had to wait out a hung call may still be on its way: ``open`` is read again until 0 or ``settle_s``."""
    cpu = [a for a, w in (await run.client.scheduler.identity())["workers"].items() if "CPU" in w.get("resources", {})]
    deadline = time.monotonic() + settle_s
    while True:
        per = await run.client.run(_env_host_counts, workers=cpu)
        out = {"envs_made": 0, "envs_closed": 0, "open": 0}
        for counts in per.values():
            for k in out:
                out[k] += counts.get(k, 0)
        if not out["open"] or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.5)


# -- one scenario ---------------------------------------------------------------------------------------
def lost_samples(result: dict, rows: list[dict], cfg: FlowConfig) -> int:
    """Samples that cannot be accounted for: unaccounted, double outcomes, trained twice or without a reward,
    and the missing members of any batch trained short."""
    a = result["accounting"]
    short = 0
    sizes = {t.group_size or cfg.rollout.group_size for t in cfg.tasks}
    if len(sizes) == 1:
        full = cfg.rollout.batch_groups * sizes.pop()
        short = sum(max(0, full - r["trajectories"]) for r in rows if r.get("kind") == "step")
    return a["unaccounted"] + a["conflicts"] + a["trained_twice"] + a["trained_without_reward"] + short


def checkpoints(out: Path) -> dict:
    """What a run left under OUT/checkpoints: whole ones, partial ones (a failed write must leave none), and whether
    ``latest`` names a whole one (weights and optimizer state)."""
    root = out / "checkpoints"
    dirs = [p for p in root.iterdir() if p.is_dir()] if root.exists() else []
    whole = sorted(p.name for p in dirs if p.name.startswith("step-") and (p / "trainer_state.pt").exists())
    latest = root / "latest"
    return {
        "whole": whole,
        "partial": sorted(p.name for p in dirs if p.name not in whole),
        "latest_whole": latest.exists() and Path(latest.read_text().strip()).name in whole,
    }


def token_lag_max(rows: list[dict]) -> int | None:
    """The most any trained token lagged behind the trainer that trained it, over the run's steps (the trainer measures it)."""
    return max((r["token_lag_max"] for r in rows if r.get("kind") == "step" and "token_lag_max" in r), default=None)


LIMIT_S = 900.0  # a scenario's run that has not ended by then hangs: a failed row, never a suite that waits for ever


async def run_in_process(cfg: FlowConfig, scenario: Scenario, out: Path, seed: int, limit_s: float = LIMIT_S) -> dict:
    from rollart_dask.entry.api import run_flow

    injector, ends = Injector(scenario, seed), {}

    async def stopped(run) -> None:
        await injector.stop()
        try:
            ends["envs"] = await env_hosts(run)
        except Exception as e:  # noqa: BLE001
            ends["envs_error"] = str(e)

    row: dict = {}
    t0 = time.monotonic()
    try:
        running = asyncio.ensure_future(run_flow(cfg, out, on_ready=injector.attach, on_stopped=stopped))
        if not (await asyncio.wait({running}, timeout=limit_s))[0]:
            row["waiting_in"] = waiting_in()  # where each task of the run stands, before they are cancelled
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            raise TimeoutError(f"the run had not ended after {limit_s:.0f} s: it hangs (waiting in: {'; '.join(row['waiting_in'])})")
        result = running.result()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        row.update(
            completed=True,
            steps=result["steps"],
            elapsed_s=result["elapsed_s"],
            accounting=result["accounting"],
            samples_lost=lost_samples(result, rows, cfg),
            counts=result["counts"],
            checkpoints=checkpoints(out),
            token_lag_max=token_lag_max(rows),
        )
    except Exception as e:  # noqa: BLE001 - a scenario that fails is a row of the table, with its error
        row.update(completed=False, error=f"{type(e).__name__}: {e}"[:400], elapsed_s=time.monotonic() - t0)
    row.update(
        faults=[f["what"] for f in injector.fired],
        fired_at=[(f["at_step"], f["at_s"]) for f in injector.fired],
        inject_errors=injector.errors,
        envs=ends.get("envs"),
        steps_redone=row.get("counts", {}).get("steps_redone", 0),
    )  # replayed on a re-created trainer
    if injector.pending:
        row["inject_errors"].append(f"{len(injector.pending)} fault(s) never fired: the run ended first")
    return row


def waiting_in() -> list[str]:
    """Each pending asyncio task's chain of awaits, innermost last: what a hung run waits for."""
    chains = []
    for task in asyncio.all_tasks():
        coro, names = task.get_coro(), []
        while coro is not None and hasattr(coro, "cr_code"):
            frame = coro.cr_frame
            names.append(f"{coro.cr_code.co_name}:{frame.f_lineno if frame else '?'}")
            coro = coro.cr_await
        if names and names[0] != "run_in_process":
            chains.append(" > ".join(names))
    return sorted(chains)


def run_killed_and_resumed(cfg: FlowConfig, scenario: Scenario, out: Path, seed: int) -> dict:
    """The whole `rollart run` process group killed mid-step (SIGKILL), then `rollart run --resume`."""
    import random

    fault = scenario.faults[0]
    out.mkdir(parents=True, exist_ok=True)
    flow = out / "flow-in.yaml"
    flow.write_text(json.dumps(cfg.model_dump(mode="json")))  # JSON is YAML
    cli = [sys.executable, "-m", "rollart_dask.entry.cli", "run", str(flow), "--out", str(out / "run")]
    t0 = time.monotonic()
    with open(out / "killed.log", "w") as log:
        proc = subprocess.Popen(cli, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics = out / "run" / "metrics.jsonl"
    steps = lambda: [json.loads(x) for x in metrics.read_text().splitlines() if '"kind": "step"' in x] if metrics.exists() else []  # noqa: E731
    while proc.poll() is None and len(steps()) < fault.after_step:
        time.sleep(0.1)
    time.sleep(random.Random(seed).uniform(0.1, 0.6))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(steps())
    latest = out / "run" / "checkpoints" / "latest"
    if not latest.exists():
        return {
            "completed": False,
            "error": "no checkpoint was written before the kill",
            "faults": [fault.describe()],
            "inject_errors": [],
            "steps_redone": 0,
        }
    ckpt = Path(latest.read_text().strip())
    at = int(ckpt.name.split("-")[1])
    time.sleep(1.0)  # the killed group's sockets and files go
    leftover = [p.pid for p in psutil.process_iter(["cmdline"]) if str(out / "run") in " ".join(p.info["cmdline"] or [])]
    remaining = cfg.trainer.steps - at
    with open(out / "resumed.log", "w") as log:
        res = subprocess.run([*cli, "--resume", "--set", f"trainer.steps={remaining}"], stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    row = {
        "faults": [fault.describe()],
        "inject_errors": [],
        "steps_redone": done_before - at,
        "elapsed_s": time.monotonic() - t0,
        "leftover_processes": len(leftover),
    }
    if res.returncode != 0:
        return {**row, "completed": False, "error": f"--resume exited {res.returncode}: {(out / 'resumed.log').read_text()[-400:]}"}
    summary = json.loads((out / "run" / "summary.json").read_text())
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    final = Path(summary["checkpoint"])
    optimizer = {str(p): _adam_steps(p) for p in (ckpt, final)}
    row.update(
        completed=True,
        steps=summary["steps"],
        accounting=summary["accounting"],
        counts=summary["counts"],
        samples_lost=lost_samples(summary, [r for r in rows if r.get("kind") == "step" and r["version"] > at], cfg),
        token_lag_max=token_lag_max(rows),
        resumed_at=at,
        final_version=summary["last"]["version"],
        optimizer_steps=optimizer,
        continued=summary["last"]["version"] == cfg.trainer.steps and optimizer[str(final)] == optimizer[str(ckpt)] + remaining,
    )
    return row


def _adam_steps(checkpoint: Path) -> int:
    """The optimizer's step count saved with a checkpoint (it goes on from there after --resume)."""
    import torch

    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)["optimizer"]["state"]
    return int(max(float(s["step"]) for s in state.values()))


@contextmanager
def shared_cluster(base: FlowConfig):
    """One cluster of the flow's workers (plain TCP on its listen address) for every scenario that leaves it as found
    (``Scenario.can_share_cluster``): its start-up paid once, not per scenario. Yields the scheduler's address."""
    from distributed import SpecCluster

    from rollart_dask.resource.cluster import cluster_spec, quiet_worker_logs

    quiet_worker_logs()
    spec = cluster_spec(base.cluster)
    with SpecCluster(workers=spec["workers"], scheduler=spec["scheduler"], silence_logs=40, name="rollart-chaos") as cluster:
        _wait_for_workers(cluster.scheduler_address, len(spec["workers"]))
        yield cluster.scheduler_address


def _wait_for_workers(scheduler: str, n: int) -> None:
    from distributed import Client

    with Client(scheduler) as client:
        client.wait_for_workers(n, timeout=120)


def run_scenario(
    base: FlowConfig,
    scenario: Scenario,
    out: Path,
    seed: int = 0,
    budget: tuple[str, ...] = TINY,
    limit_s: float = LIMIT_S,
    scheduler: str | None = None,
) -> dict:
    """One scenario, a fresh run; on the cluster at ``scheduler`` (shared_cluster) when it leaves it as found, else on
    its own embedded cluster."""
    shared = bool(scheduler) and scenario.can_share_cluster
    cfg = scenario_flow(base, scenario, (*budget, f"cluster.scheduler={scheduler}") if shared else budget)
    if shared:  # a worker the last scenario restarted is back before this run counts the pools
        _wait_for_workers(scheduler, len(base.cluster.workers))
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (a run appends to an OUT's metrics)
    before = {"processes": sandbox_processes(), "containers": sandbox_containers()}
    if any(f.action == "kill_process" for f in scenario.faults):
        row = run_killed_and_resumed(cfg, scenario, out, seed)
    else:
        row = asyncio.run(run_in_process(cfg, scenario, out, seed, limit_s))
    after = {"processes": sandbox_processes(), "containers": sandbox_containers()}
    envs = row.get("envs") or {}
    row.update(
        scenario=scenario.name,
        description=scenario.description,
        emulated=scenario.emulated,
        steps_planned=cfg.trainer.steps,
        own_workload=scenario.own_workload,
        shared_cluster=shared,
        leaked_envs=envs.get("open") if envs else None,
        leaked_processes=after["processes"] - before["processes"] + row.get("leftover_processes", 0),
        leaked_containers=None if before["containers"] is None else after["containers"] - before["containers"],
    )
    return row
