"""The chaos suite's scenarios: a real flow on the embedded default, with faults on a seeded schedule.

A scenario is flow overrides (EMULATED env and reward-endpoint faults are flow keys, labelled so in the
run's output) plus actions fired at moments of the run once step ``after_step`` is done: ``rollout``
(a seeded fraction of a second later, rollout going on), ``train`` (as the next Train is submitted,
while it runs) or ``update`` (as the engines are told to swap weights, generation suspended). Faults the runtime cannot survive yet are not
listed here: the suite shows what it proves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MOMENTS = ("rollout", "train", "update")
# faults after which the cluster is as it was (a worker its Nanny restarted, a cut connection, the run's own endpoint or
# trainer): such a scenario can run on a cluster kept for the next; losing or adding a worker, or killing the whole
# run, changes or ends the cluster, and the mooncake_master it restarts is one the embedded default starts
LEAVE_CLUSTER_AS_FOUND = {"restart_worker", "drop_scheduler", "kill_endpoint", "restart_endpoint", "fill_disk", "free_disk"}
TRAINER = "the trainer's worker"  # a fault's target: whichever worker holds the trainer when it fires


@dataclass(frozen=True)
class Fault:
    action: str  # restart_worker | lose_worker | add_worker | kill_endpoint | restart_endpoint | kill_process | fill_disk | free_disk
    target: str = ""  # a worker name (restart_worker, lose_worker, add_worker: the new one's "name:POOL,POOL")
    moment: str = "rollout"
    after_step: int = 1
    delay_s: float | None = None  # mid-rollout: this long after step after_step; None: a seeded draw in [0.1, 0.6) s

    def describe(self) -> str:
        what = {
            "restart_worker": "kill {t} (its Nanny restarts it)",
            "lose_worker": "lose {t} for good",
            "add_worker": "add worker {t}",
            "kill_endpoint": "kill the reward endpoint",
            "kill_mooncake_master": "kill the mooncake_master",
            "restart_mooncake_master": "restart the mooncake_master",
            "drop_scheduler": "drop the connection to the scheduler (the client reconnects)",
            "restart_endpoint": "restart the reward endpoint",
            "kill_process": "kill the whole run (SIGKILL), then --resume",
            "fill_disk": "EMULATED disk full for the checkpoints of {t}",
            "free_disk": "disk space freed",
        }[self.action]
        return f"{what.format(t=self.target)} mid-{self.moment} after step {self.after_step}"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    faults: tuple[Fault, ...] = ()
    overrides: tuple[str, ...] = ()  # flow keys (EMULATED injections among them)
    emulated: str = ""  # what of it is injected through flow keys, for the table
    extra_workers: tuple[str, ...] = field(default=())  # "name:POOL,POOL" added to the flow's cluster before the run
    min_steps: int = 0  # a run must outlast its faults (a worker that is added takes seconds to start)
    own_workload: bool = False  # another task than the flow's: its time is no slowdown against the baseline

    @property
    def can_share_cluster(self) -> bool:
        """Whether this scenario can run on a cluster started once for several (it leaves it as it found it)."""
        mooncake = "weights.store=mooncake" in self.overrides
        return not self.extra_workers and not mooncake and all(f.action in LEAVE_CLUSTER_AS_FOUND for f in self.faults)


ENV_FAULTS = ('tasks.0.inject={"seed": 7, "reset_fail": 0.10, "step_fail": 0.05, "hang_p": 0.01, "hang_s": 30}', "rollout.env_timeout_s=2")
ENDPOINT_FAULTS = (
    "reward.mode=serverless",
    'reward.endpoint_faults={"throttle": 0.1, "error": 0.05, "slow": 0.05, "slow_s": 1.5, "seed": 3}',
)

CODE_TASK = (
    "tasks.0.name=code",
    "tasks.0.env=code",
    "tasks.0.reward=code",
    'tasks.0.env_args={"backend": "subprocess", "max_turns": 2}',
    "tasks.0.affinity=decode",
    "tasks.0.max_turns=2",
    "tasks.0.max_tokens=48",
    "tasks.0.group_size=4",
    "tasks.0.env_concurrency=16",
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("baseline", "no faults: the reference for every slowdown"),
        Scenario(
            "env-worker-restart",
            "the env worker's process killed mid-rollout; its Nanny restarts it",
            (Fault("restart_worker", "cpu-0", "rollout", 1),),
        ),
        Scenario(
            "env-worker-lost",
            "one of two env workers lost for good mid-rollout: its envs fail over to the other",
            (Fault("lose_worker", "cpu-1", "rollout", 1),),
            extra_workers=("cpu-1:CPU",),
        ),
        Scenario(
            "env-worker-lost-mid-train",
            "an env worker lost for good while a Train is in flight",
            (Fault("lose_worker", "cpu-1", "train", 2),),
            extra_workers=("cpu-1:CPU",),
        ),
        Scenario(
            "engine-worker-restart",
            "the engine worker's process killed mid-rollout; restarted by its Nanny, it rejoins at the engines' version",
            (Fault("restart_worker", "h800-0", "rollout", 1),),
        ),
        Scenario(
            "engine-worker-restart-mid-update",
            "the engine worker killed as the engines are told to swap weights",
            (Fault("restart_worker", "h800-0", "update", 2),),
        ),
        Scenario(
            "elastic-engine",
            "an engine worker added after step 1 (it joins at the current version), the original lost for good after step 3",
            (Fault("add_worker", "h800-9:H800", "rollout", 1), Fault("lose_worker", "h800-0", "rollout", 3)),
            min_steps=24,
        ),
        Scenario(
            "trainer-worker-restart",
            "the trainer's worker killed mid-Train; restarted by its Nanny, the trainer is restored from "
            "the last checkpoint and the steps since replayed",
            (Fault("restart_worker", "train-0", "train", 3),),
            overrides=("trainer.checkpoint_every=2",),
        ),
        Scenario(
            "trainer-worker-restart-mid-update",
            "the trainer's worker killed as the engines are told to swap weights; no "
            "checkpoint yet: the trainer is rebuilt from the model and every step replayed",
            (Fault("restart_worker", "train-0", "update", 2),),
        ),
        Scenario(
            "trainer-worker-lost",
            "the trainer's worker lost for good mid-rollout: a standby TRAIN worker takes the trainer over",
            (Fault("lose_worker", TRAINER, "rollout", 2),),
            extra_workers=("train-1:TRAIN",),
        ),
        Scenario(
            "env-faults",
            "env resets fail 10%, steps 5%, 1% of calls hang past rollout.env_timeout_s",
            overrides=ENV_FAULTS,
            emulated="env reset 10% / step 5% failures, 1% hangs of 30 s (timeout 2 s)",
        ),
        Scenario(
            "reward-worker-restart",
            "the reward worker's process killed mid-rollout and restarted by its Nanny",
            (Fault("restart_worker", "reward-0", "rollout", 1),),
        ),
        Scenario(
            "reward-worker-lost",
            "one of two reward workers lost for good mid-rollout: its reward calls fail over to the other",
            (Fault("lose_worker", "reward-1", "rollout", 1),),
            extra_workers=("reward-1:SERVERLESS,REWARD",),
        ),
        Scenario(
            "reward-endpoint-faults",
            "serverless rewards; the endpoint answers 429 10%, 500 5%, 1.5 s late 5%",
            overrides=ENDPOINT_FAULTS,
            emulated="endpoint 429 10% / 500 5% / slow 5%",
        ),
        Scenario(
            "reward-endpoint-restart",
            "serverless rewards; the endpoint process killed mid-rollout, restarted 2 s later",
            (Fault("kill_endpoint", "", "rollout", 1, 0.3), Fault("restart_endpoint", "", "rollout", 1, 2.3)),
            overrides=("reward.mode=serverless",),
        ),
        Scenario(
            "scheduler-connection-drop",
            "the client's connection to the scheduler dropped mid-rollout, as a Train is submitted "
            "and 0.05 s into one; each time the client reconnects and the run goes on (a Train that ran meanwhile is not trained again)",
            (
                Fault("drop_scheduler", "", "rollout", 1),
                Fault("drop_scheduler", "", "train", 3),
                Fault("drop_scheduler", "", "train", 4, 0.05),
            ),
        ),
        Scenario(
            "mooncake-master-restart",
            "weights through Mooncake, pulled at Update; its master killed after a publish, before "
            "the engines pull it (every object it knew of gone), restarted 1 s later: publishes wait for it, lost buckets are put again",
            (Fault("kill_mooncake_master", "", "rollout", 2, 0.1), Fault("restart_mooncake_master", "", "rollout", 2, 1.1)),
            overrides=("weights.store=mooncake", "weights.pull=at_update"),
        ),
        Scenario(
            "code-env-worker-restart",
            "the code-sandbox task: its env worker's process killed mid-rollout, sandboxed runs in "
            "flight; the suite counts sandbox processes before and after",
            (Fault("restart_worker", "cpu-0", "rollout", 1),),
            overrides=CODE_TASK,
            own_workload=True,
        ),
        Scenario(
            "elastic-env",
            "an env worker added after step 1, the original one lost for good after step 3",
            (Fault("add_worker", "cpu-9:CPU", "rollout", 1), Fault("lose_worker", "cpu-0", "rollout", 3)),
            min_steps=24,
        ),
        Scenario(
            "checkpoint-disk-full",
            "every step checkpointed; the disk is full for the checkpoint writes from step 2 to step 5: "
            "each failed write is said and counted, the run goes on from the last whole checkpoint",
            (Fault("fill_disk", TRAINER, "rollout", 2, 0.0), Fault("free_disk", TRAINER, "rollout", 5, 0.0)),
            overrides=("trainer.checkpoint_every=1",),
        ),
        Scenario(
            "process-kill-resume",
            "the whole `rollart run` process killed mid-step, then `rollart run --resume`",
            (Fault("kill_process", "", "rollout", 3),),
            overrides=("trainer.checkpoint_every=1",),
        ),
    ]
}


def select(name: str) -> list[Scenario]:
    """``all``, or one or more names, comma-separated: the fault-free baseline first, then those."""
    if name == "all":
        return list(SCENARIOS.values())
    names = [n.strip() for n in name.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(f"unknown chaos scenario {', '.join(unknown) or repr(name)}; known: all, {', '.join(SCENARIOS)}")
    return [SCENARIOS["baseline"], *(SCENARIOS[n] for n in names if n != "baseline")]
