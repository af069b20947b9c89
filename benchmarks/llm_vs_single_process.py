"""How fast held-out score rises, on the same flow and the same wall-time budget, for:

  a  the runtime at α=1       `python -m rollart_dask.entry.cli run FLOW --set rollout.alpha=1 …` (its own process)
  b  the runtime at α=0       the same with rollout.mode=sync, rollout.alpha=0, rollout.level=batch (on-policy, no overlap)
  c  one process, sequential  the project's own TorchEngine and TorchTrainer in one process on every core given
                              (torch.set_num_threads(--threads), default 2): generate a batch → env + reward → advantages →
                              train → swap the adapter into the engine → repeat, evaluating greedy on the same held-out seeds
                              at the same cadence (eval.every) as the runtime; its OpenMP threads wait passively
                              (OMP_WAIT_POLICY=PASSIVE unless set: spinning threads collapse beside any busy process)
  d  TRL's GRPOTrainer        not implemented: skipped with a note (trl is never a dependency of this project)

    .venv/bin/python benchmarks/llm_vs_single_process.py                               # flows/llm_math.yaml, its 25-minute budget, 2 rounds
    .venv/bin/python benchmarks/llm_vs_single_process.py --minutes 1 --rounds 1 \\
        --set eval.seeds=8 --set rollout.group_size=4 --set rollout.batch_groups=2    # a quick look

Every arm runs in a fresh process (the runtime's arms start their embedded cluster). Arms alternate their order each
round (a b c, then c b a, …), so neither always runs first on a shared machine.

The clock. Each arm's clock starts where the runtime's own does (``elapsed_s`` in metrics.jsonl): after set-up — the
cluster, the model built and loaded by the engines and the trainer — at the start of the first held-out evaluation
(v0). Model building and loading are thus left out of every arm alike (shown as ``start-up``); the first evaluation
and every later one count in every arm's clock (the runtime goes on rolling out while it evaluates; the single
process does nothing else meanwhile). The budget (trainer.max_minutes) is checked the way the runtime checks it: after
each step, on that same clock; an arm then finishes its last step and evaluates its last version.

The score is the held-out greedy success of the flow's first task (``eval[task].success``). An evaluation in which a
seed's trajectory still failed after its retries is incomplete and is shown as such, never as a score, and never
reaches the target.

Output: one table of step times per arm and round, one of the held-out curves, one of the time to the target, and
OUT/results.json with all of it; each arm's run directory (metrics.jsonl, summary.json, its log) is under OUT.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import click

ARMS = {"a": "runtime α=1", "b": "runtime α=0 (sync)", "c": "single process", "d": "TRL GRPOTrainer"}
RUNTIME_SETS = {
    "a": ["rollout.mode=rollart", "rollout.alpha=1"],
    "b": ["rollout.mode=sync", "rollout.alpha=0", "rollout.level=batch"],
}  # (sync requires α=0 and batch level)
ENGINE_POOLS = ("H800", "H20")  # the pools engines serve (resource/pools.py); TRAIN, CPU and the reward pools are not generation
# The single process's torch runs on several OpenMP threads; by default they spin while waiting for one another, and
# with anything else busy on the box (the runtime's workers use one thread each and do not) that collapses: the same
# generate of 8 answers took 68 s on 2 threads against 4.7 s on 1 beside another busy process, and 5.9 s on 2 with
# passive waiting. So arm c waits passively unless the environment already says otherwise.
SINGLE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def common_sets(minutes: float, user_sets: tuple[str, ...]) -> list[str]:
    """What every arm runs with: the budget, no step limit but the budget, and the user's overrides last (they win)."""
    return [f"trainer.max_minutes={minutes}", "trainer.steps=100000", "observe.progress=false", *user_sets]


# ---------------------------------------------------------------------------------------------------------------------
# (c) the single process
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Group:
    """What algo/samples.build_samples reads of a finished group."""

    task: str
    kept: list = field(default_factory=list)


def play(engine, jobs: list, temperature: float, constrained: bool, clock: Counter) -> list:
    """Play every (Trajectory, TaskConfig) of ``jobs`` to its end and score it, turn by turn: each turn of every trajectory
    still going is one engine call (the engine decodes them as one batch). Returns, per job, None or the exception that
    failed it. Seconds go to ``clock``: gen_s (engine), env_s (reset, step), reward_s."""
    from rollart_dask.models.prompts import Conversation
    from rollart_dask.registry import get_reward, make_env
    from rollart_dask.types import Turn

    errors: list = [None] * len(jobs)
    t0 = time.perf_counter()
    active, done, envs = [], [], []
    for i, (traj, task) in enumerate(jobs):
        try:
            env = make_env(task.env, **task.env_args)
            envs.append(env)
            obs, _info = env.reset(seed=traj.seed)
        except Exception as e:  # noqa: BLE001 (any env error fails this trajectory alone)
            errors[i] = e
            continue
        choices = list(getattr(env, "action_choices", None) or []) if constrained else []
        active.append(
            {
                "i": i,
                "env": env,
                "chat": Conversation(task.prompt, task.max_turns),
                "obs": obs,
                "choices": choices,
                "budget": task.token_budget,
                "info": {},
                "term": False,
            }
        )
    clock["env_s"] += time.perf_counter() - t0
    try:
        while active:
            reqs = []
            for s in active:
                traj, task = jobs[s["i"]]
                s["messages"] = s["chat"].ask(s["obs"])
                req = {
                    "id": f"{traj.id}/t{len(traj.turns)}",
                    "prompt": s["messages"],
                    "temperature": temperature,
                    "max_tokens": task.max_tokens if s["budget"] is None else min(task.max_tokens, s["budget"]),
                }
                if s["choices"]:
                    req["choices"] = s["choices"]
                if task.prompt.stop:
                    req["stop"] = list(task.prompt.stop)
                reqs.append(req)
            t0 = time.perf_counter()
            completions = engine.generate(reqs)
            clock["gen_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            going = []
            for s, c in zip(active, completions):
                traj, task = jobs[s["i"]]
                s["chat"].answered(c.text)
                if s["budget"] is not None:
                    s["budget"] -= len(c.token_ids)
                if traj.version is None:
                    traj.version = c.version
                try:
                    nobs, r, term, trunc, info = s["env"].step(c.text)
                except Exception as e:  # noqa: BLE001
                    errors[s["i"]] = e
                    continue
                traj.turns.append(
                    Turn(
                        observation=s["obs"],
                        prompt_ids=c.prompt_ids,
                        response_ids=c.token_ids,
                        logprobs=c.logprobs,
                        allowed_ids=c.allowed_ids,
                        version=c.version,
                        action=c.text,
                        env_reward=float(r),
                        token_versions=c.token_versions,
                        messages=s["messages"],
                    )
                )
                s["obs"], s["info"], s["term"] = nobs, dict(info), bool(term)
                out_of_turns = len(traj.turns) >= task.max_turns or (s["budget"] is not None and s["budget"] <= 0)
                (done if term or trunc or out_of_turns else going).append(s)
            active = going
            clock["env_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for s in done:  # scored as the runtime's reward runner does: the function on the trajectory's reward view
            traj, task = jobs[s["i"]]
            traj.info = dict(s["info"], truncated=not s["term"])
            try:
                score = get_reward(task.reward)(traj.for_reward())
                traj.reward = float(score["score"])
                traj.info["reward"] = score
            except Exception as e:  # noqa: BLE001
                errors[s["i"]] = e
        clock["reward_s"] += time.perf_counter() - t0
    finally:
        for env in envs:
            getattr(env, "close", lambda: None)()
    return errors


def evaluate(engine, cfg, clock: Counter) -> dict:
    """Held-out greedy evaluation of every task on its seeds (eval.start_seed …), seeds that failed played again up to
    eval.retries rounds, as control/evaluation.play does; figures by algo/heldout.summarise (complete, failed_calls, …)."""
    from rollart_dask.algo.heldout import reason, summarise
    from rollart_dask.types import Trajectory

    t0 = time.monotonic()
    start = cfg.eval.start_seed
    seeds = {t.name: range(start, start + (t.eval_seeds or cfg.eval.seeds)) for t in cfg.tasks}
    outcomes: dict = {t.name: {} for t in cfg.tasks}
    why: dict = {t.name: {} for t in cfg.tasks}
    retried: dict = {t.name: set() for t in cfg.tasks}
    pending = [(t, s) for t in cfg.tasks for s in seeds[t.name]]
    for round_ in range(cfg.eval.retries + 1):
        jobs = [
            (Trajectory(id=f"eval-v{engine.version}-{t.name}-{s}~r{round_}", group_id="eval", task=t.name, seed=s), t) for t, s in pending
        ]
        errors = play(engine, jobs, 0.0, cfg.engine.constrained, clock)
        pending = []
        for (traj, t), err in zip(jobs, errors):
            if err is None:
                outcomes[t.name][traj.seed] = {"success": float(traj.success), "reward": float(traj.reward)}
                why[t.name].pop(traj.seed, None)
            else:
                why[t.name][traj.seed] = reason(err)
                pending.append((t, traj.seed))
        if not pending or round_ == cfg.eval.retries:
            break
        for t, s in pending:
            retried[t.name].add(s)
    seconds = time.monotonic() - t0
    return {
        t.name: summarise(outcomes[t.name], len(seeds[t.name]), seconds, dict(Counter(why[t.name].values())), len(retried[t.name]))
        for t in cfg.tasks
    }


def collect_batch(engine, cfg, rng: random.Random, step: int, clock: Counter) -> list[Group]:
    """batch_groups groups, each group_size members of one (task, seed) drawn as the runtime's launcher draws them
    (control/launcher.draw_group: by task weight, seeds below eval.start_seed), sampled at engine.temperature."""
    from rollart_dask.algo.heldout import reason
    from rollart_dask.control.launcher import draw_group
    from rollart_dask.types import Trajectory

    tasks = {t.name: t for t in cfg.tasks}
    groups, jobs = [], []
    for g in range(cfg.rollout.batch_groups):
        name, seed = draw_group(rng, tasks, cfg.eval.start_seed)
        size = tasks[name].group_size or cfg.rollout.group_size
        group = Group(name, [Trajectory(id=f"s{step}-g{g}/{m}", group_id=f"s{step}-g{g}", task=name, seed=seed) for m in range(size)])
        groups.append(group)
        jobs += [(t, tasks[name]) for t in group.kept]
    errors = play(engine, jobs, cfg.engine.temperature, cfg.engine.constrained, clock)
    failed = [e for e in errors if e is not None]
    if failed:  # (the runtime relaunches a failed trajectory; an in-process env or reward that raises is a bug to see)
        raise RuntimeError(f"step {step}: {len(failed)} of {len(jobs)} trajectories failed; the first: {reason(failed[0])}") from failed[0]
    return groups


def policy_weights(engine) -> dict:
    """What the trainer publishes, as the engine holds it now: the adapter (trainer.lora) or the whole model."""
    if engine.lora is not None:
        from rollart_dask.data.lora import adapter_state

        return adapter_state(engine.model)
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def run_single(cfg, out_dir: Path, threads: int) -> dict:
    """Arm (c): the whole GRPO loop in this process. Writes OUT/metrics.jsonl (step and eval rows, the runtime's keys
    where they mean the same) and returns the summary (also OUT/summary.json)."""
    import torch

    from rollart_dask.algo.advantages import advantage_fn
    from rollart_dask.algo.samples import build_samples
    from rollart_dask.data.engine_torch import TorchEngine
    from rollart_dask.data.trainer_torch import TorchTrainer
    from rollart_dask.models.prepare import prepare_model
    from rollart_dask.registry import stateful_reward

    if cfg.emulated:
        raise click.ClickException("arm c needs a real model: this flow's engine and trainer are emulated")
    if cfg.trainer.backend != "torch":
        raise click.ClickException(f"arm c trains with the torch trainer; this flow's trainer.backend is {cfg.trainer.backend}")
    for t in cfg.tasks:
        if stateful_reward(t.reward) is not None:
            raise click.ClickException(f"arm c scores rewards in-process; task {t.name}'s reward {t.reward!r} needs an engine of its own")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_build = time.perf_counter()
    model_dir = prepare_model(cfg)
    torch.manual_seed(cfg.seed)
    engine = TorchEngine(str(model_dir), seed=cfg.seed, max_batch=cfg.engine.max_batch, lora=cfg.trainer.lora)
    trainer = TorchTrainer.from_config(cfg.trainer, model_dir=str(model_dir), seed=cfg.seed, temperature=cfg.engine.temperature)
    torch.set_num_threads(threads)  # (from_config set the worker's torch_threads: here every core given, one thing at a time)
    startup_s = time.perf_counter() - t_build
    advantage = advantage_fn(cfg.trainer.advantage, cfg.trainer.adv_scale)
    rng = random.Random(cfg.seed)  # the launcher's generator: the same (task, seed) sequence as the runtime draws
    initial = policy_weights(engine)
    rows: list[dict] = []
    log = (out_dir / "metrics.jsonl").open("w")
    totals: Counter = Counter()

    def write(row: dict) -> None:
        row = {"time": time.time(), **row}
        rows.append(row)
        log.write(json.dumps(row, default=float) + "\n")
        log.flush()

    t_start = time.monotonic()

    def do_eval() -> None:
        clock: Counter = Counter()
        t0 = time.monotonic()
        figures = evaluate(engine, cfg, clock)
        totals["eval_s"] += time.monotonic() - t0
        write(
            {
                "kind": "eval",
                "step": engine.version,
                "version": engine.version,
                "eval": figures,
                "elapsed_s": time.monotonic() - t_start,
                "eval_s": time.monotonic() - t0,
                "eval_gen_s": clock["gen_s"],
            }
        )
        first = figures[cfg.tasks[0].name]
        shown = f"{first['success']:.3f}" if first["complete"] else f"incomplete ({first['failed_calls']} of {first['seeds']} failed)"
        print(
            f"[single process] held-out {cfg.tasks[0].name} at v{engine.version}: {shown} ({time.monotonic() - t_start:.0f} s)", flush=True
        )

    try:
        do_eval()
        for number in range(1, cfg.trainer.steps + 1):
            clock: Counter = Counter()
            t_step = time.perf_counter()
            groups = collect_batch(engine, cfg, rng, number, clock)
            t0 = time.perf_counter()
            samples, stats = build_samples(groups, advantage)
            clock["samples_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            train = trainer.train_step(samples)
            clock["train_call_s"] += time.perf_counter() - t0
            version = int(train.pop("version"))
            t0 = time.perf_counter()
            engine.update_weights(version, trainer.state_dict())
            clock["swap_s"] += time.perf_counter() - t0
            step_s = time.perf_counter() - t_step
            totals.update(clock)
            totals["step_s"] += step_s
            write(
                {
                    "kind": "step",
                    "step": version,
                    "version": version,
                    **stats,
                    "elapsed_s": time.monotonic() - t_start,
                    "step_s": step_s,
                    **{k: clock[k] for k in ("gen_s", "env_s", "reward_s", "samples_s", "train_call_s", "swap_s")},
                    **train,
                }
            )
            if cfg.eval.every and version % cfg.eval.every == 0:
                do_eval()
            if cfg.trainer.max_minutes and time.monotonic() - t_start > cfg.trainer.max_minutes * 60:
                print(f"[single process] time limit of {cfg.trainer.max_minutes} min reached after {number} steps", flush=True)
                break
        if rows[-1]["kind"] != "eval":  # (the runtime too evaluates its last version)
            do_eval()
    finally:
        log.close()
    final = policy_weights(engine)
    published = trainer.state_dict()
    common = sorted(set(final) & set(published))
    evals = [r for r in rows if r["kind"] == "eval"]
    summary = {
        "arm": ARMS["c"],
        "threads": threads,
        "startup_s": startup_s,
        "steps": engine.version,
        "elapsed_s": time.monotonic() - t_start,
        "first": evals[0],
        "last": evals[-1],
        "seconds": dict(totals),
        "weights": {
            "lora": cfg.trainer.lora is not None,
            "tensors": len(final),
            "max_abs_change": max((float((final[k] - initial[k]).abs().max()) for k in final), default=0.0),
            "engine_equals_trainer": bool(common) and all(torch.equal(final[k], published[k]) for k in common),
            "engine_version": engine.version,
            "trainer_version": trainer.version,
        },
    }
    summary["weights"]["changed"] = summary["weights"]["max_abs_change"] > 0
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary


# ---------------------------------------------------------------------------------------------------------------------
# reading an arm's metrics.jsonl (the runtime's, or the single process's)
# ---------------------------------------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def step_times(rows: list[dict], arm: str) -> dict:
    """Seconds per step and their split, averaged over the steps whose interval holds no evaluation.

    runtime (a, b): a step's interval runs from the previous step row's ``elapsed_s`` to its own (both taken when Get
    Batch had its batch). gen_s = the engines' busy seconds in it (pool_busy of the engine pools × the interval);
    train_s = the trainer's seconds for the update (the row's train_s); wait_batch_s = get_batch_s (the loop waiting
    for rollout to finish a batch); wait_train_s = the loop waiting for the Train to publish (at α=0 the training
    itself is inside it: rollout is stopped meanwhile); swap_s = suspend + update + recompute-KV.
    single process (c): each step timed directly (step_s); gen_s = engine.generate; train_s = the trainer's seconds;
    swap_s = the adapter moved into the engine; other_s = env reset/step, reward, advantages and samples, and the
    train call beyond the trainer's own timing. Nothing waits: the pieces run one after the other."""
    steps = sorted((r for r in rows if r["kind"] == "step"), key=lambda r: r["elapsed_s"])
    evals = [r["elapsed_s"] for r in rows if r["kind"] == "eval"]
    out = {"steps": len(steps)}
    if arm == "c":
        kept = steps
        train = [r.get("train_s", r["train_call_s"]) for r in kept]
        out.update(
            n=len(kept),
            step_s=_mean([r["step_s"] for r in kept]),
            gen_s=_mean([r["gen_s"] for r in kept]),
            train_s=_mean(train),
            wait_batch_s=None,
            wait_train_s=None,
            swap_s=_mean([r["swap_s"] for r in kept]),
            other_s=_mean([r["step_s"] - r["gen_s"] - t - r["swap_s"] for r, t in zip(kept, train)]),
        )
        return out
    wall, gen, train, wb, wt, swap = [], [], [], [], [], []
    for prev, r in zip(steps, steps[1:]):
        lo, hi = prev["elapsed_s"], r["elapsed_s"]
        if any(lo < e <= hi for e in evals):  # an evaluation ended inside: its generation and wall are not a step's
            continue
        dt = hi - lo
        wall.append(dt)
        busy = r.get("pool_busy") or {}
        if any(p in busy for p in ENGINE_POOLS):
            gen.append(sum(busy.get(p, 0.0) for p in ENGINE_POOLS) * dt)
        if "train_s" in r:
            train.append(r["train_s"])
        wb.append(r.get("get_batch_s", 0.0))
        wt.append(r.get("wait_train_s", 0.0))
        swap.append(sum(r.get(k, 0.0) for k in ("suspend_s", "update_s", "recompute_kv_s")))
    out.update(
        n=len(wall),
        step_s=_mean(wall),
        gen_s=_mean(gen),
        train_s=_mean(train),
        wait_batch_s=_mean(wb),
        wait_train_s=_mean(wt),
        swap_s=_mean(swap),
        other_s=None,
    )
    return out


def curve(rows: list[dict], task: str) -> list[dict]:
    """The held-out evaluations on the arm's clock: elapsed seconds (from the first evaluation's start), version, score
    (None when incomplete), complete, failed_calls."""
    out = []
    for r in rows:
        if r["kind"] != "eval" or task not in r.get("eval", {}):
            continue
        fig = r["eval"][task]
        complete = bool(fig.get("complete", fig.get("failed_calls", 0) == 0))
        out.append(
            {
                "elapsed_s": round(r["elapsed_s"], 2),
                "version": r["version"],
                "score": fig["success"] if complete else None,
                "complete": complete,
                "failed_calls": fig.get("failed_calls", 0),
                "seeds": fig.get("seeds"),
                "eval_s": round(r.get("eval_s", 0.0), 2),
            }
        )
    return out


def first_reaching(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["complete"] and p["score"] >= target - 1e-12), None)


# ---------------------------------------------------------------------------------------------------------------------
# running the arms
# ---------------------------------------------------------------------------------------------------------------------
def run_process(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> tuple[int, float, float]:
    """Run ``cmd`` in its own process group, its output to ``log_path``; (return code, launch time, wall seconds). Past
    ``timeout_s`` the group (the run and the workers it started) is ended: TERM, then KILL."""
    launched = time.time()
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = 124
    return rc, launched, time.monotonic() - t0


def run_arm(arm: str, flow: str, run_dir: Path, sets: list[str], threads: int, minutes: float) -> dict:
    import shutil

    if run_dir.exists():  # the runtime refuses a directory that holds a run: this arm's own folder, made afresh
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if arm in RUNTIME_SETS:
        cmd = [sys.executable, "-m", "rollart_dask.entry.cli", "run", flow, "--out", str(run_dir)]
        for s in [*RUNTIME_SETS[arm], *sets]:
            cmd += ["--set", s]
    else:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--flow",
            flow,
            "--single-process-run",
            str(run_dir),
            "--threads",
            str(threads),
        ]
        for s in sets:
            cmd += ["--set", s]
    env = dict(os.environ)
    if arm == "c" and threads > 1:  # several OpenMP threads spin while they wait for each other: see SINGLE_ENV
        env = {**SINGLE_ENV, **env}  # (what the caller's environment sets wins)
    (run_dir.parent / f"{run_dir.name}.cmd").write_text(" ".join(cmd) + "\n")
    log = run_dir.parent / f"{run_dir.name}.log"
    load = os.getloadavg()[0]
    rc, launched, wall = run_process(cmd, log, timeout_s=max(1800.0, 3 * minutes * 60 + 900), env=env)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()] if (run_dir / "metrics.jsonl").exists() else []
    res = {
        "arm": arm,
        "name": ARMS[arm],
        "dir": str(run_dir),
        "log": str(log),
        "rc": rc,
        "process_wall_s": round(wall, 1),
        "rows": rows,
        "load_at_start": round(load, 2),
        **({"omp_wait_policy": env.get("OMP_WAIT_POLICY")} if arm == "c" else {}),
    }
    evals = [r for r in rows if r["kind"] == "eval"]
    if evals:  # set-up before the first evaluation began: launch → (first eval row written − its duration)
        res["startup_s"] = round(evals[0]["time"] - evals[0].get("eval_s", 0.0) - launched, 1)
        res["first_eval_s"] = round(evals[0].get("eval_s", 0.0), 1)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"{ARMS[arm]} ended with code {rc} (log: {log}); its last lines:\n  " + "\n  ".join(tail), file=sys.stderr)
    return res


def trl_note() -> str:
    try:
        import trl  # noqa: F401
    except ImportError:
        return "arm d (TRL's GRPOTrainer) skipped: trl is not importable here (it is not a dependency of this project; install it yourself to compare)"
    return (
        f"arm d (TRL's GRPOTrainer) skipped: trl {getattr(sys.modules['trl'], '__version__', '?')} is importable, but this arm is "
        f"not implemented (it was written where trl could not be installed, so could not be tested)"
    )


def fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def report(runs: list[dict], task: str, target: float, target_rule: str, flow: str, minutes: float) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # (a log file: wide enough that the tables keep their columns)
        console = Console(width=160)
    t = Table(title=f"seconds per step ({flow}, {minutes:g} min per arm; steps whose interval holds an evaluation left out)")
    for col in (
        "round",
        "arm",
        "steps",
        "s/step",
        "gen",
        "train",
        "wait batch",
        "wait trainer",
        "swap",
        "other",
        "start-up s",
        "v0 eval s",
    ):
        t.add_column(col, justify="right" if col not in ("arm",) else "left")
    for r in runs:
        s = r["step_times"]
        t.add_row(
            str(r["round"]),
            r["name"],
            str(s["steps"]),
            fmt(s["step_s"]),
            fmt(s["gen_s"]),
            fmt(s["train_s"]),
            fmt(s["wait_batch_s"]),
            fmt(s["wait_train_s"]),
            fmt(s["swap_s"]),
            fmt(s["other_s"]),
            fmt(r.get("startup_s"), 0),
            fmt(r.get("first_eval_s"), 0),
        )
    console.print(t)
    busy = [r for r in runs if r.get("load_at_start", 0) >= 0.5]
    if busy:
        console.print(
            f"[yellow]the machine was busy when {len(busy)} of {len(runs)} arms started (1-minute load "
            f"{', '.join(str(r['load_at_start']) for r in busy)}): its timings are not a comparison[/yellow]"
        )
    console.print(
        "[dim]s/step: wall seconds per step. gen: seconds the engine spent generating in it (runtime: engine pools' busy share × "
        "the step; α=1 generates while it trains, so the columns need not add up). train: the trainer's seconds for the update. "
        "wait batch: the runtime's step loop waiting for rollout to finish a batch. wait trainer: the loop waiting for the "
        "Train to publish (at α=0 the training is inside it: rollout stops meanwhile). swap: weights into the engine(s). "
        "other (single process): env, reward, advantages. start-up: launch → first evaluation (cluster, model build and "
        "load; not on the clock). v0 eval s: the first evaluation (on the clock).[/dim]"
    )

    c = Table(title=f"held-out {task} success (greedy) — seconds on each arm's clock → version → score")
    for col in ("round", "arm", "curve"):
        c.add_column(col)
    for r in runs:
        pts = [
            f"{p['elapsed_s']:.0f}s v{p['version']} "
            + (f"{p['score']:.3f}" if p["complete"] else f"incomplete ({p['failed_calls']}/{p['seeds']} failed)")
            for p in r["curve"]
        ]
        c.add_row(str(r["round"]), r["name"], " · ".join(pts) or "no evaluation")
    console.print(c)

    by_round: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["arm"]] = r
    tt = Table(title=f"time to held-out ≥ {target:.3f} ({target_rule})")
    for col in ("round", "arm", "reached at", "version", "best held-out", "last eval at"):
        tt.add_column(col, justify="right" if col not in ("arm",) else "left")
    ratios = []
    for rnd, arms in sorted(by_round.items()):
        for r in arms.values():
            hit = r["target"]
            best = max((p["score"] for p in r["curve"] if p["complete"]), default=None)
            last = r["curve"][-1]["elapsed_s"] if r["curve"] else None
            tt.add_row(
                str(rnd),
                r["name"],
                f"{hit['elapsed_s']:.0f} s" if hit else "not reached",
                str(hit["version"]) if hit else "—",
                fmt(best, 3),
                fmt(last, 0),
            )
        if "a" in arms and "c" in arms:
            ratios.append(ratio(arms["c"], arms["a"], rnd))
    console.print(tt)
    for q in ratios:
        console.print(f"round {q['round']}: single process ÷ α=1 time to target = {q['text']}")
    return ratios


def ratio(single: dict, alpha1: dict, rnd: int) -> dict:
    """single-process time ÷ α=1 time (≥ 1: α=1 sooner); a bound when one of them did not reach the target (its last
    evaluation's time then stands for it: it would have been later than that)."""
    hs, ha = single["target"], alpha1["target"]
    last = lambda r: r["curve"][-1]["elapsed_s"] if r["curve"] else None  # noqa: E731
    if hs and ha:
        v = hs["elapsed_s"] / max(ha["elapsed_s"], 1e-9)
        return {"round": rnd, "ratio": v, "bound": None, "text": f"{v:.2f}"}
    if ha and not hs and last(single):
        v = last(single) / max(ha["elapsed_s"], 1e-9)
        return {"round": rnd, "ratio": v, "bound": ">", "text": f"> {v:.2f} (single process did not reach it)"}
    if hs and not ha and last(alpha1):
        v = hs["elapsed_s"] / max(last(alpha1), 1e-9)
        return {"round": rnd, "ratio": v, "bound": "<", "text": f"< {v:.2f} (α=1 did not reach it)"}
    return {"round": rnd, "ratio": None, "bound": None, "text": "n/a (neither reached the target)"}


@click.command()
@click.option("--flow", default="flows/llm_math.yaml", show_default=True)
@click.option("--minutes", default=None, type=float, help="wall-time budget per arm (trainer.max_minutes); default: the flow's")
@click.option("--rounds", default=2, show_default=True, help="rounds; the arms' order alternates each round")
@click.option(
    "--arms", default="abcd", show_default=True, help="which arms, e.g. ac (a: runtime α=1, b: runtime α=0, c: single process, d: TRL)"
)
@click.option("--target", default=None, type=float, help="held-out success to reach (default: the first evaluation's score + 0.2)")
@click.option("--out", default="runs/bench-llm-vs-single-process", show_default=True)
@click.option("--threads", default=2, show_default=True, help="torch threads of the single process (the machine's cores)")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="a flow override for every arm, e.g. --set eval.seeds=8")
@click.option("--single-process-run", default=None, hidden=True, help="(internal) run arm c alone into this folder")
def main(flow, minutes, rounds, arms, target, out, threads, sets, single_process_run):
    from rollart_dask.config import load_flow

    if single_process_run:  # arm c in its own process: the parent gave the budget and the overrides in --set
        cfg = load_flow(flow, list(sets))
        run_single(cfg, Path(single_process_run), threads)
        return
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise click.BadParameter(f"unknown arm(s) {''.join(sorted(unknown))}; choose from {''.join(ARMS)}", param_hint="--arms")
    order = [a for a in ARMS if a in arms]
    if "d" in order:
        print(trl_note())
        order.remove("d")
    cfg = load_flow(flow, list(sets))
    minutes = minutes if minutes is not None else cfg.trainer.max_minutes
    if not minutes:
        raise click.BadParameter("the flow has no trainer.max_minutes: give --minutes", param_hint="--minutes")
    task = cfg.tasks[0].name
    sets_all = common_sets(minutes, sets)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(1, rounds + 1):
        for arm in order if rnd % 2 else order[::-1]:
            print(f"round {rnd}: {ARMS[arm]} ({minutes:g} min)", flush=True)
            res = run_arm(arm, flow, out / f"r{rnd}-{arm}", sets_all, threads, minutes)
            res["round"] = rnd
            res["curve"] = curve(res["rows"], task)
            res["step_times"] = step_times(res["rows"], arm)
            runs.append(res)
    if not runs:
        raise click.ClickException("no arm to run")
    firsts = [r["curve"][0]["score"] for r in runs if r["curve"] and r["curve"][0]["complete"]]
    if target is None:
        if not firsts:
            raise click.ClickException("no arm has a complete first evaluation to set the target from: give --target")
        target, rule = (
            statistics.fmean(firsts) + 0.2,
            f"the first evaluation's score {statistics.fmean(firsts):.3f} (mean of the arms') + 0.2",
        )
    else:
        rule = "given"
    for r in runs:
        r["target"] = first_reaching(r["curve"], target)
    ratios = report(runs, task, target, rule, flow, minutes)
    results = {
        "flow": flow,
        "minutes": minutes,
        "rounds": rounds,
        "arms": {a: ARMS[a] for a in order},
        "sets": list(sets),
        "task": task,
        "target": target,
        "target_rule": rule,
        "first_scores": firsts,
        "ratios_single_over_alpha1": ratios,
        "clock": "seconds from the start of each arm's first evaluation (after its set-up and model loads)",
        "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs],
    }
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    print(f"results: {out / 'results.json'}")
    if any(r["rc"] != 0 for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
