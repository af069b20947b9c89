"""SampleBuffer: GRPO groups, redundancy and the staleness bound, as a pure state machine.

No Dask, no asyncio: the control plane feeds it events (a group opened, a trajectory started
at a version, finished, failed) and carries out what it answers (launch these members,
cancel those). Tested without a cluster.

Rules (docs/concepts/asynchrony.md):
- A group of size G (per task) launches G + r members; the first G to finish are kept, the rest are
  cancelled and counted as redundant.
- A member that fails or is aborted is replaced: from the redundant members still running,
  else by relaunching one (at most ``max_relaunch`` per group; after that the group is
  dropped and counted).
- Staleness: with the policy at version n, a member started by version < n - alpha (or n - max_lag, when
  rollout.max_trained_lag is tighter) is aborted (running) or evicted (finished), counted, and replaced.
- Fairness (``fairness="task"``, control/fairness.py): batches are filled by a per-task quota that keeps
  the admitted mix, and stale replacements are not charged to ``max_relaunch``.
- Accounting: every trajectory id launched ends in exactly one outcome of ``OUTCOMES`` (``ledger``);
  ``account()`` adds what is still running or finished-but-untrained when asked.
"""

from __future__ import annotations

import math

from collections import Counter
from dataclasses import dataclass, field

from rollart_dask.control.fairness import FAIRNESS, mix_shift, quota
from rollart_dask.types import Trajectory

RUNNING, KEPT, CANCELLED, FAILED, STALE = "running", "kept", "cancelled", "failed", "stale"
# where a launched trajectory ends: trained, or why not (the last two only while the run goes on, or at its end)
OUTCOMES = ("trained", "aborted_stale", "evicted_stale", "redundant", "failed", "dropped_with_group", "in_flight", "finished_untrained")

LAG_PARTS = ("in_flight", "in_queue")  # a trained trajectory's staleness = versions in flight + versions in the queue


@dataclass
class Group:
    id: str
    task: str
    seed: int
    size: int  # G: members kept for training
    members: dict[str, str] = field(default_factory=dict)  # traj id → state
    versions: dict[str, int] = field(default_factory=dict)  # traj id → start version
    kept: list[Trajectory] = field(default_factory=list)
    relaunches: int = 0
    next_index: int = 0
    ordinal: int = 0  # its place in launch order

    def member_index(self, traj_id: str) -> int:
        return int(traj_id.rsplit("/", 1)[1])

    def running(self) -> list[str]:
        return [t for t, s in self.members.items() if s == RUNNING]


@dataclass
class Orders:
    """What the control plane must do after an event."""

    launch: list[tuple[str, str]] = field(default_factory=list)  # (group id, trajectory id)
    cancel: list[str] = field(default_factory=list)  # trajectory ids to abort

    def extend(self, other: "Orders") -> "Orders":
        self.launch += other.launch
        self.cancel += other.cancel
        return self


class SampleBuffer:
    def __init__(
        self,
        group_size: int,
        redundancy: int = 0,
        alpha: int = 1,
        max_relaunch: int = 3,
        fairness: str = "none",
        max_lag: int | None = None,
        ordered: bool = False,
    ):
        if fairness not in FAIRNESS:
            raise ValueError(f"fairness {fairness!r} is not one of {', '.join(FAIRNESS)}")
        self.G, self.r, self.alpha, self.max_relaunch, self.fairness = group_size, redundancy, alpha, max_relaunch, fairness
        self.max_lag = alpha if max_lag is None else min(alpha, max_lag)  # the floor's distance (rollout.max_trained_lag)
        self.ordered = ordered  # rollout.deterministic: batches in launch order, members by index, never by arrival
        self.groups: dict[str, Group] = {}
        self.complete: list[str] = []  # group ids with G kept members, in completion order
        self.counts: Counter = Counter()
        self.opened = 0
        self.dropped = 0
        self.launched: Counter = Counter()  # task → groups opened
        self.dropped_of: Counter = Counter()  # task → groups dropped
        self.trained: Counter = Counter()  # task → groups taken for training
        self.mix_at_take: dict = mix_shift(self.launched, self.trained)  # the mix as the last batch was taken (launches go on after)
        self.ledger: dict[str, str] = {}  # trajectory id → its outcome, once it has one
        self.members_launched = 0

    # -- events ---------------------------------------------------------------------------
    def open_group(self, group_id: str, task: str, seed: int, size: int | None = None) -> Orders:
        """Open a group of ``size`` kept members (default: the buffer's G); launches size + r."""
        g = Group(group_id, task, seed, size or self.G, ordinal=self.opened)
        self.groups[group_id] = g
        self.opened += 1
        self.launched[task] += 1
        return Orders(launch=[self._new_member(g) for _ in range(g.size + self.r)])

    def started(self, traj_id: str, version: int) -> None:
        g = self._group_of(traj_id)
        if g is not None:
            g.versions.setdefault(traj_id, version)

    def finished(self, traj: Trajectory) -> Orders:
        g = self.groups.get(traj.group_id)
        if g is None or g.members.get(traj.id) != RUNNING:
            self.counts["late"] += 1  # cancelled or dropped before it finished: already counted
            return Orders()
        g.members[traj.id] = KEPT
        g.versions.setdefault(traj.id, traj.version if traj.version is not None else 0)
        g.kept.append(traj)
        self.counts["finished"] += 1
        orders = Orders()
        if len(g.kept) == g.size:
            for t in g.running():
                g.members[t] = CANCELLED
                orders.cancel.append(t)
                self.counts["redundant_dropped"] += 1
                self._end(t, "redundant")
            self.complete.append(g.id)
        return orders

    def failed(self, traj_id: str, reason: str = "failed") -> Orders:
        g = self._group_of(traj_id)
        if g is None or g.members.get(traj_id) != RUNNING:
            return Orders()
        g.members[traj_id] = FAILED
        self.counts[reason] += 1
        self._end(traj_id, "failed")
        return self._refill(g)

    def enforce_staleness(self, policy_version: int) -> Orders:
        """Abort running and evict finished members started before policy_version - alpha (or the tighter max_lag)."""
        floor = policy_version - self.max_lag
        orders = Orders()
        for g in list(self.groups.values()):
            if min(g.versions.values(), default=floor) >= floor:  # (the common case, without a look at each member)
                continue
            stale = [t for t, v in g.versions.items() if v < floor and g.members.get(t) in (RUNNING, KEPT)]
            if not stale:
                continue
            for t in stale:
                if g.members[t] == RUNNING:
                    orders.cancel.append(t)
                    self.counts["aborted_stale"] += 1
                    self._end(t, "aborted_stale")
                else:
                    g.kept = [k for k in g.kept if k.id != t]
                    self.counts["evicted_stale"] += 1
                    self._end(t, "evicted_stale")
                g.members[t] = STALE
            if g.id in self.complete and len(g.kept) < g.size:
                self.complete.remove(g.id)
            orders.extend(self._refill(g, stale=True))
        return orders

    # -- batches --------------------------------------------------------------------------
    def ready(self) -> int:
        return len(self.complete)

    def take(self, n_groups: int) -> list[Group] | None:
        """Pop n complete groups (call enforce_staleness first), or None if there are not yet: the first n to
        complete, or with fairness the first complete ones of each task's quota (control/fairness.py). Ordered: the
        n first launched groups still open, once all of them are complete, their members sorted by index."""
        if self.ordered:
            ids = sorted(self.groups, key=lambda i: self.groups[i].ordinal)[:n_groups]
            if len(ids) < n_groups or not set(ids) <= set(self.complete):
                return None
            for i in ids:
                g = self.groups[i]
                g.kept.sort(key=lambda t: g.member_index(t.id))
        else:
            ids = self._fair_batch(n_groups) if self.fairness == "task" else self.complete[:n_groups]
        if ids is None or len(ids) < n_groups:
            return None
        chosen = set(ids)
        self.complete = [i for i in self.complete if i not in chosen]
        out = [self.groups.pop(i) for i in ids]
        for g in out:
            for t in g.kept:
                self._end(t.id, "trained")
        self.counts["groups_trained"] += len(out)
        self.trained.update(g.task for g in out)
        self.mix_at_take = self.mix()
        return out

    def _fair_batch(self, n: int) -> list[str] | None:
        q = quota(self.launched - self.dropped_of, self.trained, n)
        if q is None:
            return None
        ids = []
        for task, k in q.items():
            mine = [i for i in self.complete if self.groups[i].task == task][:k]
            if len(mine) < k:
                return None  # the quota waits for this task's groups
            ids += mine
        return sorted(ids, key=self.complete.index)

    def mix(self) -> dict:
        """Launched vs trained task shares since the buffer began, and their largest gap (fairness.mix_shift)."""
        return mix_shift(self.launched, self.trained)

    @property
    def admitted(self) -> int:
        """Groups opened and not dropped: what the launcher's admission bound counts."""
        return self.opened - self.dropped

    def account(self) -> dict:
        """Launched trajectories by outcome (``OUTCOMES``), those still running or finished but untrained included;
        ``unaccounted`` (launched, no outcome) and ``conflicts`` (a second outcome for one id) are 0 when nothing is lost."""
        out = Counter(self.ledger.values())
        for g in self.groups.values():
            for t, state in g.members.items():
                if t not in self.ledger:
                    out["in_flight" if state == RUNNING else "finished_untrained"] += 1
        return {
            "launched": self.members_launched,
            **{k: out[k] for k in OUTCOMES},
            "unaccounted": self.members_launched - sum(out.values()),
            "conflicts": self.counts["ledger_conflicts"],
        }

    def in_flight(self) -> list[str]:
        return [t for g in self.groups.values() for t in g.running()]

    def staleness(self, policy_version: int, groups: list[Group]) -> list[int]:
        return [policy_version - (t.version or 0) for g in groups for t in g.kept]

    @staticmethod
    def lag(policy_version: int, groups: list[Group], now: float) -> dict:
        """Each trained trajectory's staleness (trainer version at Train − start version) split in two: in flight (the
        versions the engines installed while it ran) and in the queue (from its finish to the Train that uses it), in
        versions, and the queue's wait in seconds: p50, p90 and max over the batch; ``lag_hist``: both parts'
        histograms (versions → trajectories), for the page."""
        kept = [t for g in groups for t in g.kept if t.finished_version is not None]
        if not kept:
            return {}
        parts = {
            "lag_in_flight": [t.finished_version - (t.version or 0) for t in kept],
            "lag_in_queue": [policy_version - t.finished_version for t in kept],
            "queue_s": [now - t.finished_at for t in kept if t.finished_at is not None],
        }
        out = {f"{name}_{q}": v for name, values in parts.items() if values for q, v in _quantiles(values).items()}
        out["lag_hist"] = {part: {str(k): n for k, n in sorted(Counter(parts[f"lag_{part}"]).items())} for part in LAG_PARTS}
        return out

    # -- internals ------------------------------------------------------------------------
    def _new_member(self, g: Group) -> tuple[str, str]:
        tid = f"{g.id}/{g.next_index}"
        g.next_index += 1
        g.members[tid] = RUNNING
        self.members_launched += 1
        return g.id, tid

    def _end(self, traj_id: str, outcome: str) -> None:
        if traj_id in self.ledger:
            self.counts["ledger_conflicts"] += 1
            return
        self.ledger[traj_id] = outcome

    def _refill(self, g: Group, stale: bool = False) -> Orders:
        need = g.size - len(g.kept) - len(g.running())
        if need <= 0:
            return Orders()
        if stale and self.fairness == "task":  # staleness never drops a group's task from training: not charged
            self.counts["relaunched_stale"] += need
            return Orders(launch=[self._new_member(g) for _ in range(need)])
        if g.relaunches + need > self.max_relaunch:
            return self._drop(g)
        g.relaunches += need
        self.counts["relaunched"] += need
        return Orders(launch=[self._new_member(g) for _ in range(need)])

    def _drop(self, g: Group) -> Orders:
        orders = Orders(cancel=g.running())
        for t in orders.cancel:
            g.members[t] = CANCELLED
        for t in [t for t, state in g.members.items() if state in (RUNNING, CANCELLED, KEPT) and t not in self.ledger]:
            self._end(t, "dropped_with_group")
        self.groups.pop(g.id, None)
        if g.id in self.complete:
            self.complete.remove(g.id)
        self.dropped += 1
        self.dropped_of[g.task] += 1
        self.counts["groups_dropped"] += 1
        return orders

    def _group_of(self, traj_id: str) -> Group | None:
        return self.groups.get(traj_id.rsplit("/", 1)[0])


def _quantiles(values: list[float]) -> dict:
    """p50, p90 (nearest rank) and max of a non-empty list."""
    ordered = sorted(values)
    return {f"p{q}": ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)] for q in (50, 90)} | {"max": ordered[-1]}
