"""A user's env and reward code that fails in the ways users' code does (tests/test_user_faults_cluster.py)."""
import time

from envs.frozenlake import FrozenLakeText
from rewards.frozenlake import reward as frozenlake_reward


def nan_on_even_turns(trajectory):
    return float("nan") if len(trajectory["turns"]) % 2 == 0 else frozenlake_reward(trajectory)


def always_raises(trajectory):
    return trajectory["no such key"]


def returns_string(trajectory):
    return "1.0"


def returns_inf(trajectory):
    return {"score": float("inf")}


class StepRaises(FrozenLakeText):
    def step(self, action):
        raise RuntimeError("the user's step is broken")


class StepHangs(FrozenLakeText):
    def step(self, action):
        time.sleep(10)  # past the test's 2 s env timeout; bounded, so the shared cluster's env threads come back


class DictObservation(FrozenLakeText):
    def reset(self, seed):
        obs, info = super().reset(seed=seed)
        return {"text": obs}, info
