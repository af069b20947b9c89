"""Held-out evaluation: a task's seeds played through the run's own engines, envs and rewards (the figures:
algo/heldout.py). The run evaluates this way every ``eval.every`` steps; `rollart eval` does it for any
checkpoint on any seed range, and compares two checkpoints seed by seed (a paired difference)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from rollart_dask.algo.seeding import EVAL, mixed_seed
from rollart_dask.algo.heldout import incomplete_note, is_complete, reason, summarise
from rollart_dask.config import FlowConfig
from rollart_dask.observe import console
from rollart_dask.types import Trajectory


async def play_all(em, chosen: dict, tag: str, version: int, temperature: float, cfg: FlowConfig) -> tuple[dict, dict]:
    """Every task of ``chosen`` (name → (task, seeds)) played at once (a slow task, sandboxed code, does not serialise behind
    the others): figures and outcomes by task. A task whose figures are incomplete (failed calls) is said. Failed seeds are
    played again up to ``eval.retries`` rounds; with ``rollout.deterministic`` sampled episodes draw from seeds of the run's
    seed, the version, the task and the env seed."""
    seeded = cfg.rollout.deterministic
    base = lambda name: mixed_seed(cfg.seed, EVAL, version, *name.encode()) if seeded else None  # noqa: E731
    played = await asyncio.gather(*(play(em, t, seeds, tag, temperature, cfg.eval.retries, base(t.name)) for t, seeds in chosen.values()))
    out = {name: figures for name, (figures, _) in zip(chosen, played)}
    for name, fig in out.items():  # (markup off: a failure's message may hold brackets)
        if not is_complete(fig):
            console.print(f"held-out {name} at v{version}: {incomplete_note(fig)}", markup=False, style="yellow")
    return out, {name: outcomes for name, (_, outcomes) in zip(chosen, played)}


async def play(
    em, task, seeds: range, tag: str, temperature: float = 0.0, retries: int = 0, sampling_seed: int | None = None
) -> tuple[dict, dict[int, dict]]:
    """Play ``task`` on ``seeds`` (all at once: a slow env does not serialise the others); its figures and outcomes by seed,
    played greedy (``temperature`` 0) or sampled at ``temperature`` (pass@1 of one sample per seed).
    Seeds whose trajectory failed (raised, not a wrong answer) are played again, together, up to ``retries`` rounds;
    a cancelled one (the run is stopping) is not: it counts as failed, and a cancelled ``play`` raises as before."""
    from rollart_dask.control.proxy import TrajectoryCancelled

    t0 = time.monotonic()
    outcomes: dict[int, dict] = {}
    why: dict[int, str] = {}
    pending, retried, retried_for = list(seeds), set(), Counter()  # (retried_for: why the seeds played again had failed)
    for round_ in range(retries + 1):
        # a new id each round: the env host refuses a reset of a trajectory it has closed
        trajs = [
            Trajectory(
                id=f"eval-{tag}-{task.name}-{s}" + (f"~r{round_}" if round_ else ""),
                group_id="eval",
                task=task.name,
                seed=s,
                sampling_seed=None if sampling_seed is None else mixed_seed(sampling_seed, s),  # a replayed seed draws alike
            )
            for s in pending
        ]
        results = await asyncio.gather(*(em.run(t, task, eval_temperature=temperature) for t in trajs), return_exceptions=True)
        pending, cancelled = [], False
        for t, r in zip(trajs, results):
            if isinstance(r, Trajectory):
                outcomes[t.seed] = {"success": float(t.success), "reward": float(t.reward)}
                why.pop(t.seed, None)
                continue
            why[t.seed] = reason(r)
            if isinstance(r, (asyncio.CancelledError, TrajectoryCancelled)):
                cancelled = True
            else:
                pending.append(t.seed)
        if not pending or cancelled or round_ == retries:
            break
        retried.update(pending)
        retried_for.update(why[s] for s in pending)
    return summarise(outcomes, len(seeds), time.monotonic() - t0, dict(Counter(why.values())), len(retried), dict(retried_for)), outcomes
