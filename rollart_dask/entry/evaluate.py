"""`rollart eval`: any saved checkpoint on any task's held-out range (or a given seed range), through the
run's own engine, env and reward path: the flow the checkpoint was trained with is set up again on its
cluster, the checkpoint restored into the trainer and published to the engines, and the seeds played."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from rollart_dask.config import FlowConfig, FlowError, load_flow
from rollart_dask.algo.heldout import is_complete, paired


def locate(target: str | Path) -> tuple[Path, Path]:
    """(the run directory, the checkpoint) of a checkpoint directory (RUN/checkpoints/step-N) or a run directory (its latest)."""
    p = Path(target)
    if (p / "trainer_state.pt").exists():
        run_dir = p.parent.parent
    elif (p / "checkpoints" / "latest").exists():
        run_dir, p = p, Path((p / "checkpoints" / "latest").read_text().strip())
    else:
        raise FileNotFoundError(
            f"{target}: neither a checkpoint (a directory with trainer_state.pt, e.g. RUN/checkpoints/step-40) "
            "nor a run directory with checkpoints/latest"
        )
    if not (run_dir / "flow.yaml").exists():
        raise FileNotFoundError(f"{target}: the checkpoint's run directory {run_dir} has no flow.yaml to set the evaluation up with")
    return run_dir, p


def eval_flow(run_dir: Path, overrides: list[str]) -> FlowConfig:
    """The run's effective flow (what `rollart run` wrote), with ``overrides``: no training, no warm start, no trackers."""
    data = yaml.safe_load((run_dir / "flow.yaml").read_text())
    data.pop("_effective", None)
    cfg = load_flow(
        data=data, overrides=["warmstart.steps=0", "observe.tensorboard=false", "observe.loggers=[]", "observe.progress=false", *overrides]
    )
    if cfg.emulated:
        raise FlowError(f"{run_dir}: an EMULATED flow (engine.backend emulated) has no policy to evaluate")
    return cfg


def select_tasks(cfg: FlowConfig, names: tuple[str, ...]) -> list:
    known = {t.name: t for t in cfg.tasks}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise FlowError(f"--task {', '.join(unknown)}: no such task in the run's flow; its tasks: {', '.join(known)}")
    return [known[n] for n in names] if names else list(cfg.tasks)


async def evaluate(
    target: str | Path,
    out: Path,
    tasks: tuple[str, ...] = (),
    seeds: int | None = None,
    start: int | None = None,
    temperature: float | None = None,
    overrides: tuple[str, ...] = (),
) -> dict:
    """Evaluate one checkpoint; {checkpoint, version, seeds [start, stop), figures by task, outcomes by task and seed}."""
    from rollart_dask.entry.api import started

    run_dir, checkpoint = locate(target)
    cfg = eval_flow(run_dir, list(overrides))
    chosen = select_tasks(cfg, tasks)
    begin = cfg.eval.start_seed if start is None else start
    given = None if seeds is None and start is None else range(begin, begin + (seeds or cfg.eval.seeds))  # None: the run's held-out
    temperature = cfg.eval.temperature if temperature is None else temperature
    async with started(cfg, out, resume=checkpoint) as run:
        figures = await run.evaluate(given, chosen, temperature)
        return {
            "checkpoint": str(checkpoint.resolve()),
            "run": str(run_dir.resolve()),
            "version": run.engine_version,
            "start_seed": begin,
            "held_out": given is None,
            "temperature": temperature,
            "eval": figures,
            "outcomes": run.outcomes,
        }


def compare(a: dict, b: dict) -> dict:
    """A − B per task on the seeds both played: success and reward, each with its paired 95% interval; ``complete``
    False when either evaluation is (its seeds that failed are left out, so the difference is not the checkpoints')."""
    return {
        task: {
            **{key: paired(a["outcomes"][task], b["outcomes"][task], key) for key in ("success", "reward")},
            "complete": is_complete(a["eval"][task]) and is_complete(b["eval"][task]),
        }
        for task in a["outcomes"]
        if task in b["outcomes"]
    }


def evaluate_sync(*args, **kwargs) -> dict:
    return asyncio.run(evaluate(*args, **kwargs))
