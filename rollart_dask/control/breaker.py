"""The circuit breaker on the user's code: a task whose env or reward keeps failing stops the run within seconds,
naming the task, the call, the exception and its traceback, instead of relaunching trajectories that fail again.

A user fault is what the user's code did (usercode.UserFunctionError from an env host or a reward runner, a Lambda
function's own error, a reward value that is not a finite number, an env call that hung past rollout.env_timeout_s),
never what the infrastructure did (a lost worker, an endpoint down): those stay with the recovery paths. Failures
below the thresholds are counted and the run goes on. Pure: no cluster, testable alone.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from rollart_dask.control.dispatch import CallFailed

USER_TYPES = ("UserFunctionError:", "RewardValueError:", "RewardFunctionError:")
CALLS = {"env-reset": "reset", "env-step": "step", "reward": "reward"}


class UserCodeFailed(RuntimeError):
    """One trajectory failed in the user's code: ``task``, ``call`` (reset / step / reward) and the error as reported."""

    def __init__(self, task: str, call: str, detail: str):
        super().__init__(f"task {task!r}: {call} failed: {detail}")
        self.task, self.call, self.detail = task, call, detail


class UserFault(RuntimeError):
    """The run stopped because a task's user code failed past rollout.user_faults."""


def is_user_fault(stage: str, e: BaseException) -> bool:
    if isinstance(e, TimeoutError):  # the dispatcher's: an env call that outlived rollout.env_timeout_s hung in the user's env
        return stage in ("env-reset", "env-step")
    if isinstance(e, CallFailed):
        reported = str(e).split(": ", 1)[-1]  # CallFailed reads "<stage>: <Type>: <message>"
        return reported.startswith(USER_TYPES)
    return False


def as_user_fault(stage: str, task: str, e: BaseException) -> BaseException:
    """``e`` as a UserCodeFailed when the user's code caused it, else ``e`` itself."""
    if not is_user_fault(stage, e):
        return e
    detail = str(e).split(": ", 1)[-1].removeprefix("UserFunctionError: ") if isinstance(e, CallFailed) else f"{type(e).__name__}: {e}"
    return UserCodeFailed(task, CALLS[stage], detail)


class FaultBreaker:
    """Per task, counted in groups (the trajectories of one problem: a reward that fails on one problem fails its whole
    group at once): trips after ``consecutive`` groups in a row with a failed trajectory, or when more than ``share``
    of the trajectories of its last ``window`` groups failed (once ``window`` groups have ended). The share counts
    trajectories, not groups: failures scattered at 10% touch most groups of 8 (1 − 0.9⁸ = 57%) and must not stop the
    run. ``consecutive`` 0: never trips (failures are still counted). A call without a group is a group of its own."""

    def __init__(self, consecutive: int, share: float, window: int):
        self.consecutive, self.share, self.window = consecutive, share, window
        self.recent: dict[str, OrderedDict] = {}  # task → group → [failed, ended] trajectories (its last `window` groups)
        self.streak: dict[str, dict] = {}  # task → the groups of its current run of failures → their failed trajectories
        self.failures: Counter = Counter()  # (task, call) → failed trajectories
        self.first: dict[str, UserCodeFailed] = {}  # task → its first failure (the traceback the error shows)
        self.tripped = False

    def ok(self, task: str, group: str | None = None) -> None:
        self._mark(task, group, False)
        self.streak[task] = {}

    def failed(self, e: UserCodeFailed, group: str | None = None) -> UserFault | None:
        """Count one failed trajectory; the UserFault that stops the run once the task is past a threshold."""
        key = self._mark(e.task, group, True)
        streak = self.streak.setdefault(e.task, {})
        streak[key] = streak.get(key, 0) + 1
        self.failures[e.task, e.call] += 1
        self.first.setdefault(e.task, e)
        if not self.consecutive or self.tripped:
            return None
        recent = self.recent[e.task]
        n, bad, ended = len(recent), sum(f for f, _ in recent.values()), sum(t for _, t in recent.values())
        if len(streak) >= self.consecutive:
            why = f"{len(streak)} groups in a row failed ({sum(streak.values())} trajectories)"
        elif n >= self.window and bad > self.share * ended:
            why = f"{bad} of the {ended} trajectories of its last {n} groups failed (more than rollout.user_faults.share={self.share})"
        else:
            return None
        self.tripped = True  # once: the run is stopping
        counts = ", ".join(f"{call} {k}" for (t, call), k in sorted(self.failures.items()) if t == e.task)
        first = self.first[e.task]
        return UserFault(
            f"stopped: task {e.task!r}: {why} in its {e.call}: {e.detail.splitlines()[0]}\n"
            f"failed trajectories so far by call: {counts}. The first one:\n{first.detail}\n"
            "(a fault of the task's env or reward code; the thresholds are rollout.user_faults)"
        )

    def _mark(self, task: str, group: str | None, failed: bool):
        groups = self.recent.setdefault(task, OrderedDict())
        key = group if group is not None else object()
        counts = groups.setdefault(key, [0, 0])
        counts[0] += failed
        counts[1] += 1
        groups.move_to_end(key)
        while len(groups) > self.window:
            groups.popitem(last=False)
        return key
