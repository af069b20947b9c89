from rollart_dask.envs.frozenlake import FrozenLakeText, parse_action
from rollart_dask.rewards.frozenlake import reward
from rollart_dask.algo.advantages import grpo_advantages
from rollart_dask.registry import get_reward, make_env


def test_deterministic_by_seed_and_maps_differ():
    a, b = FrozenLakeText(), FrozenLakeText()
    assert a.reset(5)[0] == b.reset(5)[0]
    maps = {FrozenLakeText().reset(s)[0] for s in range(20)}
    assert len(maps) > 10


def test_observation_format():
    obs, info = FrozenLakeText().reset(3)
    rows = obs.split("\n")
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    assert obs.count("P") == 1 and set(obs) <= set("SFHGP\n")


def test_shortest_path_reaches_goal():
    for seed in range(10):
        env = FrozenLakeText()
        env.reset(seed)
        path = env.shortest_path()
        assert path is not None
        for a in path:
            obs, r, term, trunc, info = env.step(a)
        assert term and r == 1.0 and info["success"]


def test_malformed_action_counted_and_agent_stays():
    env = FrozenLakeText(max_turns=8)
    obs, _ = env.reset(1)
    obs2, r, term, trunc, info = env.step("jump!")
    assert obs2 == obs and info["malformed"] == 1 and not info["valid"] and r == 0.0
    assert parse_action(" left ") == "L" and parse_action("d") == "D" and parse_action("LL") is None


def test_truncation_at_max_turns():
    env = FrozenLakeText(max_turns=2)
    env.reset(1)
    env.step("?")
    assert env.step("?")[3] is True


def test_reward_function_and_registry():
    assert reward({"info": {"success": True, "malformed": 0}}) == {"score": 1.0, "success": True}
    assert reward({"info": {"success": False, "malformed": 3}})["score"] == -0.3
    assert get_reward("frozenlake") is reward
    assert isinstance(make_env("frozenlake", size=5), FrozenLakeText)
    import pytest

    with pytest.raises(KeyError, match="unknown env 'nope'"):
        make_env("nope")


def test_progress_reward_follows_the_shortest_path_left_and_a_fall_earns_none():
    """frozenlake-progress: short of the goal, part of the way covered counts (the env reports the BFS distance left); a
    fall, none; the goal, 1 as with the plain reward."""
    from rollart_dask.rewards.frozenlake import PROGRESS_WEIGHT, progress

    assert get_reward("frozenlake-progress") is progress
    env = FrozenLakeText(size=4, max_turns=20)
    _, info = env.reset(3)
    path, start = env.shortest_path(), info["start_distance"]
    assert start == info["distance"] == len(path) > 1
    _, _, _, _, info = env.step(path[0])  # one step along the way
    assert info["distance"] == start - 1 and not info["fell"]
    assert progress({"info": info})["score"] == round(PROGRESS_WEIGHT * (1 / start), 6)
    for move in path[1:]:
        _, _, done, _, info = env.step(move)
    assert done and info["success"] and progress({"info": info}) == {"score": 1.0, "success": True}
    for seed in range(50):  # a map where some first move falls into a hole
        _, info = env.reset(seed)
        falls = [m for m in "LDRU" if _falls(seed, m)]
        if falls:
            _, _, done, _, info = env.step(falls[0])
            assert done and info["fell"] and info["distance"] is None
            assert progress({"info": {**info, "malformed": 1}})["score"] == -0.1
            return
    raise AssertionError("no map of 50 has a hole next to the start")


def _falls(seed: int, move: str) -> bool:
    env = FrozenLakeText(size=4)
    env.reset(seed)
    return env.step(move)[4]["fell"]


def test_grpo_advantages():
    adv = grpo_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv[0] > 0 and all(a < 0 for a in adv[1:]) and abs(sum(adv)) < 1e-5
    assert grpo_advantages([0.5] * 4) == [0.0] * 4


def test_cli_envs_list_and_try():
    from click.testing import CliRunner

    from rollart_dask.entry.cli import main

    res = CliRunner().invoke(main, ["envs", "list"])
    assert res.exit_code == 0 and "frozenlake" in res.output and "rollart_dask.envs.frozenlake:FrozenLakeText" in res.output
    env = FrozenLakeText()
    env.reset(3)
    path = env.shortest_path()
    res = CliRunner().invoke(main, ["envs", "try", "frozenlake", "--seed", "3"], input="jump\n" + "\n".join(path) + "\n")
    assert res.exit_code == 0, res.output
    assert "'malformed': 1" in res.output and "reward 1.0" in res.output and "terminated" in res.output
    res = CliRunner().invoke(main, ["envs", "try", "nope"])
    assert res.exit_code != 0 and "unknown env 'nope'" in res.output


def test_env_and_reward_names_are_taken_once():
    import pytest

    from rollart_dask.registry import make_env, register_env, register_reward

    with pytest.raises(ValueError, match="env 'frozenlake' is already registered"):
        register_env("frozenlake", "rollart_dask.envs.sokoban:SokobanText")
    with pytest.raises(ValueError, match="reward 'math' is already registered"):
        register_reward("math", "rollart_dask.rewards.frozenlake:reward")
    with pytest.raises(KeyError, match="unknown env 'nope'; registered: .*frozenlake"):
        make_env("nope")


def test_old_top_level_names_still_resolve_and_a_users_own_envs_wins(tmp_path, monkeypatch):
    """envs/ and rewards/ install as rollart_dask.envs and rollart_dask.rewards; 'envs.…:X' from an older flow
    resolves to them with a warning naming the new path, unless the user has an `envs` package of their own."""
    import sys

    import pytest

    from rollart_dask.registry import current_module_name
    from rollart_dask.registry import get_reward, make_env
    from rollart_dask.rewards.frozenlake import reward as ours

    current_module_name.cache_clear()
    with pytest.warns(FutureWarning, match="write 'rollart_dask.envs.frozenlake'"):
        assert type(make_env("envs.frozenlake:FrozenLakeText")) is FrozenLakeText
    with pytest.warns(FutureWarning, match="write 'rollart_dask.rewards.frozenlake'"):
        assert get_reward("rewards.frozenlake:reward") is ours

    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    (tmp_path / "envs" / "frozenlake.py").write_text("class FrozenLakeText:\n    mine = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "envs" or m.startswith("envs.")]:
        monkeypatch.delitem(sys.modules, name)
    current_module_name.cache_clear()
    try:
        assert make_env("envs.frozenlake:FrozenLakeText").mine  # theirs: no redirect into ours
        assert type(make_env("frozenlake")) is FrozenLakeText  # and ours by its registry name
    finally:
        current_module_name.cache_clear()
