"""Which reward worker a reward call is pinned to, as workers leave and join (no cluster needed)."""

from rollart_dask.config import EngineConfig, RolloutConfig
from rollart_dask.control.envmanager import EnvManager


def test_reward_calls_take_the_reward_workers_in_turn_and_skip_lost_ones():
    em = EnvManager(
        None,
        None,
        ["cpu-0"],
        RolloutConfig(),
        EngineConfig(),
        reward_pool="SERVERLESS",
        reward_workers={"SERVERLESS": ["r0", "r1"], "REWARD": ["r1"]},
    )
    assert {em._reward_worker("SERVERLESS") for _ in range(4)} == {"r0", "r1"}
    em.worker_lost("r1")
    assert {em._reward_worker("SERVERLESS") for _ in range(4)} == {"r0"} and em._reward_worker("REWARD") is None
    em.reward_worker_joined("r2", {"SERVERLESS": 1e6, "REWARD": 1e6})  # a restarted worker comes back under a new address
    assert {em._reward_worker("SERVERLESS") for _ in range(4)} == {"r0", "r2"} and em._reward_worker("REWARD") == "r2"
    em.reward_worker_joined("cpu-1", {"CPU": 1e6})  # not a reward worker
    assert "cpu-1" not in {em._reward_worker("SERVERLESS") for _ in range(6)}
