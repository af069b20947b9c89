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


@dataclass(frozen=True)
class Fault:
    action: str  # restart_worker | lose_worker | add_worker | kill_endpoint | restart_endpoint | kill_process
    target: str = ""  # a worker name (restart_worker, lose_worker, add_worker: the new one's "name:POOL,POOL")
    moment: str = "rollout"
    after_step: int = 1
    delay_s: float | None = None  # mid-rollout: this long after step after_step; None: a seeded draw in [0.1, 0.6) s

    def describe(self) -> str:
        what = {"restart_worker": "kill {t} (its Nanny restarts it)", "lose_worker": "lose {t} for good", "add_worker": "add worker {t}",
                "kill_endpoint": "kill the reward endpoint", "restart_endpoint": "restart the reward endpoint",
                "kill_process": "kill the whole run (SIGKILL), then --resume"}[self.action]
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


ENV_FAULTS = ('tasks.0.inject={"seed": 7, "reset_fail": 0.10, "step_fail": 0.05, "hang_p": 0.01, "hang_s": 30}',
              "rollout.env_timeout_s=2")
ENDPOINT_FAULTS = ("reward.mode=serverless", 'reward.endpoint_faults={"throttle": 0.1, "error": 0.05, "slow": 0.05, "slow_s": 1.5, "seed": 3}')

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("baseline", "no faults: the reference for every slowdown"),
    Scenario("env-worker-restart", "the env worker's process killed mid-rollout; its Nanny restarts it",
             (Fault("restart_worker", "cpu-0", "rollout", 1),)),
    Scenario("env-worker-lost", "one of two env workers lost for good mid-rollout: its envs fail over to the other",
             (Fault("lose_worker", "cpu-1", "rollout", 1),), extra_workers=("cpu-1:CPU",)),
    Scenario("env-worker-lost-mid-train", "an env worker lost for good while a Train is in flight",
             (Fault("lose_worker", "cpu-1", "train", 2),), extra_workers=("cpu-1:CPU",)),
    Scenario("engine-worker-restart", "the engine worker's process killed mid-rollout; restarted by its Nanny, it rejoins at the "
             "engines' version", (Fault("restart_worker", "h800-0", "rollout", 1),)),
    Scenario("engine-worker-restart-mid-update", "the engine worker killed as the engines are told to swap weights",
             (Fault("restart_worker", "h800-0", "update", 2),)),
    Scenario("elastic-engine", "an engine worker added after step 1 (it joins at the current version), the original lost for good "
             "after step 3", (Fault("add_worker", "h800-9:H800", "rollout", 1), Fault("lose_worker", "h800-0", "rollout", 3)), min_steps=24),
    Scenario("env-faults", "env resets fail 10%, steps 5%, 1% of calls hang past rollout.env_timeout_s", overrides=ENV_FAULTS,
             emulated="env reset 10% / step 5% failures, 1% hangs of 30 s (timeout 2 s)"),
    Scenario("reward-worker-restart", "the reward worker's process killed mid-rollout and restarted by its Nanny",
             (Fault("restart_worker", "reward-0", "rollout", 1),)),
    Scenario("reward-endpoint-faults", "serverless rewards; the endpoint answers 429 10%, 500 5%, 1.5 s late 5%", overrides=ENDPOINT_FAULTS,
             emulated="endpoint 429 10% / 500 5% / slow 5%"),
    Scenario("reward-endpoint-restart", "serverless rewards; the endpoint process killed mid-rollout, restarted 2 s later",
             (Fault("kill_endpoint", "", "rollout", 1, 0.3), Fault("restart_endpoint", "", "rollout", 1, 2.3)),
             overrides=("reward.mode=serverless",)),
    Scenario("elastic-env", "an env worker added after step 1, the original one lost for good after step 3",
             (Fault("add_worker", "cpu-9:CPU", "rollout", 1), Fault("lose_worker", "cpu-0", "rollout", 3)), min_steps=24),
    Scenario("process-kill-resume", "the whole `rollart run` process killed mid-step, then `rollart run --resume`",
             (Fault("kill_process", "", "rollout", 3),), overrides=("trainer.checkpoint_every=1",)),
]}


def select(name: str) -> list[Scenario]:
    if name == "all":
        return list(SCENARIOS.values())
    if name not in SCENARIOS:
        raise ValueError(f"unknown chaos scenario {name!r}; known: all, {', '.join(SCENARIOS)}")
    return [SCENARIOS["baseline"], SCENARIOS[name]] if name != "baseline" else [SCENARIOS["baseline"]]
