"""The pre-flight: before any generation, each task's env is made on an env worker, reset and stepped through one
episode (its expert's actions, else its first allowed action), and the task's reward is called on that trajectory
the way the run will call it (the deployed Lambda function, or in-process). An unknown env or reward name, bad
env_args, an observation that is not text, an env or reward that raises, a reward that is not a finite number: all
are reported together, naming task and call, before the run starts (``rollart check FLOW`` runs only this)."""

from __future__ import annotations

import asyncio

from rollart_dask.config import FlowConfig, FlowError, TaskConfig
from rollart_dask.control.breaker import UserCodeFailed
from rollart_dask.data import tasks
from rollart_dask.types import Trajectory, Turn


class PreflightError(FlowError):
    """What the pre-flight found wrong, every task's at once."""


async def check(cfg: FlowConfig, services) -> dict[str, dict]:
    """Each task's pre-flight result ({turns, reward}); PreflightError listing every problem found."""
    cpu = services.poolmap.members("CPU")
    results = await asyncio.gather(*(_one(t, services, cpu[i % len(cpu)]) for i, t in enumerate(cfg.tasks)), return_exceptions=True)
    problems = [f"task {t.name!r}: {r}" for t, r in zip(cfg.tasks, results) if isinstance(r, BaseException)]
    if problems:
        raise PreflightError(
            f"pre-flight: {len(problems)} of {len(cfg.tasks)} tasks fail before any generation "
            "(each task's env played one episode, its reward called on it):\n- " + "\n- ".join(problems)
        )
    return dict(zip((t.name for t in cfg.tasks), results))


async def _one(task: TaskConfig, s, worker: str) -> dict:
    item = {"env": task.env, "env_args": task.env_args, "seed": 0, "max_turns": task.max_turns}
    try:
        episode = await s.d.submit_one("preflight", tasks.env_preflight, item, pool="CPU", worker=worker)
    except Exception as e:
        raise RuntimeError(f"env: {_said(e)}") from None
    if "user_error" in episode:
        raise RuntimeError(f"env: {episode['user_error']}")
    traj = Trajectory(
        id=f"preflight-{task.name}",
        group_id="preflight",
        task=task.name,
        seed=0,
        info=episode["info"],
        turns=[
            Turn(
                observation=t["observation"],
                prompt_ids=[],
                response_ids=[],
                logprobs=[],
                allowed_ids=None,
                version=0,
                action=t["action"],
                env_reward=t["env_reward"],
            )
            for t in episode["turns"]
        ],
    )
    try:
        score = await s.em.score(task, traj)
    except Exception as e:
        raise RuntimeError(f"reward: {_said(e)}") from None
    return {"turns": len(traj.turns), "reward": score}


def _said(e: BaseException) -> str:
    if isinstance(e, UserCodeFailed):
        return e.detail
    return str(e).replace("UserFunctionError: ", "") or type(e).__name__
