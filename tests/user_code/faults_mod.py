"""A user's env and reward code that fails in the ways users' code does (tests/test_user_faults_*.py).

The ``*_later`` ones fail only past the pre-flight's episode (seed 0): faults that only show on the run's own
trajectories, which the circuit breaker must catch; the others fail at once, which the pre-flight must catch."""

import time

from rollart_dask.envs.frozenlake import FrozenLakeText
from rollart_dask.rewards.frozenlake import reward as frozenlake_reward


def nan_on_even_turns(trajectory):  # (past the pre-flight's episode)
    return float("nan") if trajectory["seed"] != 0 and len(trajectory["turns"]) % 2 == 0 else frozenlake_reward(trajectory)


def always_raises(trajectory):
    return trajectory["no such key"]


def returns_string(trajectory):
    return "1.0"


def returns_inf(trajectory):
    return {"score": float("inf")}


def raises_later(trajectory):
    return frozenlake_reward(trajectory) if trajectory["seed"] == 0 else trajectory["no such key"]


def string_later(trajectory):
    return frozenlake_reward(trajectory) if trajectory["seed"] == 0 else "1.0"


def inf_later(trajectory):
    return frozenlake_reward(trajectory) if trajectory["seed"] == 0 else {"score": float("inf")}


class StepRaises(FrozenLakeText):
    def step(self, action):
        raise RuntimeError("the user's step is broken")


class DictObservation(FrozenLakeText):
    def reset(self, seed):
        obs, info = super().reset(seed=seed)
        return {"text": obs}, info


class _Later(FrozenLakeText):
    def reset(self, seed):
        self.later = seed != 0
        return super().reset(seed=seed)


class StepRaisesLater(_Later):
    def step(self, action):
        if self.later:
            raise RuntimeError("the user's step is broken")
        return super().step(action)


class StepHangsLater(_Later):
    def step(self, action):
        if self.later:
            time.sleep(10)  # past the test's 2 s env timeout; bounded, so the shared cluster's env threads come back
        return super().step(action)


class DictObservationLater(_Later):
    def step(self, action):
        obs, *rest = super().step(action)
        return ({"text": obs} if self.later else obs, *rest)


def raises_on_a_tenth(trajectory):  # 10% of the run's trajectories, by seed: below the breaker's thresholds
    if trajectory["seed"] != 0 and trajectory["seed"] % 10 == 3:
        raise ValueError("one reward in ten fails")
    return frozenlake_reward(trajectory)


class ResetRaises(FrozenLakeText):
    def reset(self, seed):
        raise RuntimeError("the user's reset is broken")
