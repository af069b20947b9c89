import json
import random
import re

import pytest

from rollart_dask.envs.adapters import GymnasiumText, TextArenaEnv
from rollart_dask.envs.sokoban import SokobanText, parse_action, parse_level
from rollart_dask.rewards.env_return import reward as env_return_reward
from rollart_dask.rewards.sokoban import reward as sokoban_reward

HELD_OUT = 1_000_000


# -- Sokoban ------------------------------------------------------------------------------
def test_sokoban_deterministic_by_seed_and_levels_differ():
    for seed in (5, HELD_OUT + 3):
        a, b = SokobanText(), SokobanText()
        assert a.reset(seed) == b.reset(seed)
    levels = {SokobanText().reset(s)[0] for s in range(50)}
    assert len(levels) > 40


def test_sokoban_observation_format():
    obs, info = SokobanText().reset(3)
    rows = obs.split("\n")
    assert len(rows) == 6 and all(len(r) == 6 for r in rows)
    assert set(obs) <= set("#_@$.*+\n")
    assert rows[0] == rows[-1] == "######" and all(r[0] == r[-1] == "#" for r in rows)
    assert obs.count("@") + obs.count("+") == 1
    assert obs.count("$") + obs.count("*") == 1 == obs.count(".") + obs.count("*") + obs.count("+")
    assert info["level"] == obs and json.dumps(info)


def test_sokoban_every_level_solvable_and_plan_replays():
    lengths = []
    for seed in list(range(150)) + list(range(HELD_OUT, HELD_OUT + 50)):
        env = SokobanText()
        _, info = env.reset(seed)
        plan = env.shortest_path()
        assert plan is not None and len(plan) == info["optimal_moves"], seed
        assert 2 <= len(plan) <= 8
        lengths.append(len(plan))
        for i, a in enumerate(plan):
            obs, r, term, _trunc, step_info = env.step(a)
            assert term == (i == len(plan) - 1), (seed, plan, i)
        assert r == 1.0 and step_info["success"] and step_info["boxes_on_target"] == step_info["boxes"] == 1
        assert "$" not in obs and obs.count("*") == 1
        assert sokoban_reward({"info": step_info}) == {"score": 1.0, "success": True}
        json.dumps(step_info)
    assert len(set(lengths)) >= 4  # a spread of difficulties, not one length


def test_sokoban_bigger_levels_and_window():
    for seed in range(10):
        env = SokobanText(width=7, height=7, boxes=2, walls=2, min_moves=5, max_moves=12)
        obs, info = env.reset(seed)
        assert obs.count("$") + obs.count("*") == 2 and 5 <= info["optimal_moves"] <= 12
        for a in env.shortest_path():
            *_, info = env.step(a)
        assert info["success"] and info["boxes_on_target"] == 2


def test_sokoban_malformed_action_counted_and_player_stays():
    env = SokobanText(max_turns=8)
    obs, _ = env.reset(1)
    obs2, r, term, _trunc, info = env.step("jump!")
    assert obs2 == obs and info["malformed"] == 1 and not info["valid"] and r == 0.0 and not term
    obs3, *_, info = env.step("")
    assert obs3 == obs and info["malformed"] == 2 and info["turns"] == 2
    assert parse_action(" left ") == "L" and parse_action("d") == "D" and parse_action("Up") == "U"
    assert parse_action("LL") is None and parse_action("north") is None


def test_sokoban_walls_and_boxes_block():
    env = SokobanText()
    level = "######\n#@$#.#\n#____#\n######"
    obs, _ = env.load(level)
    assert obs == level
    for a in "LUR":  # wall left, wall above, box pushed into a wall
        obs, r, term, _, info = env.step(a)
        assert obs == level and info["valid"] and info["malformed"] == 0 and r == 0.0 and not term
    assert info["deadlock"] and env.shortest_path() is None  # that box can never reach the target

    level = "######\n#+$*_#\n######"  # player on a target; a box cannot push another box
    obs, _ = env.load(level)
    assert obs == level
    obs, *_, info = env.step("R")
    assert obs == level and info["boxes_on_target"] == 1 and info["boxes"] == 2 and not info["success"]

    obs, _ = env.load("#####\n#@$.#\n#####")
    obs, r, term, _, info = env.step("right")
    assert obs == "#####\n#_@*#\n#####" and r == 1.0 and term and info["success"]

    env = SokobanText(end_on_deadlock=True)
    env.load("######\n#@$#.#\n#____#\n######")
    *_, term, _trunc, info = env.step("D")
    assert term and not info["success"] and info["deadlock"]

    with pytest.raises(ValueError):
        parse_level("#####\n#@$_#\n#####")  # a box without a target
    with pytest.raises(ValueError):
        SokobanText(width=2)


def test_sokoban_truncation_and_reward_values():
    env = SokobanText(max_turns=2)
    env.reset(1)
    env.step("?")
    assert env.step("?")[3] is True
    assert sokoban_reward({"info": {"success": False, "malformed": 0, "boxes_on_target": 0, "boxes": 1}}) == {
        "score": 0.0,
        "success": False,
    }
    assert sokoban_reward({"info": {"success": False, "malformed": 0, "boxes_on_target": 1, "boxes": 2}})["score"] == 0.05
    assert sokoban_reward({"info": {"success": False, "malformed": 2, "boxes_on_target": 1, "boxes": 2}})["score"] == -0.15
    assert sokoban_reward({"info": {"success": True, "malformed": 1, "boxes_on_target": 2, "boxes": 2}})["score"] == 0.9
    assert sokoban_reward({"info": {"success": False, "malformed": 0, "boxes_on_target": 2, "boxes": 3}})["score"] < 1.0


def test_registry_resolves_module_attr_names():
    from rollart_dask.registry import get_reward, make_env

    assert isinstance(make_env("rollart_dask.envs.sokoban:SokobanText", boxes=1), SokobanText)
    assert get_reward("rollart_dask.rewards.sokoban:reward") is sokoban_reward
    assert isinstance(make_env("rollart_dask.envs.adapters:GymnasiumText", env_id="Taxi-v4"), GymnasiumText)
    assert get_reward("rollart_dask.rewards.env_return:reward") is env_return_reward


# -- Gymnasium ----------------------------------------------------------------------------
def test_gymnasium_frozenlake_choices_win_and_malformed():
    env = GymnasiumText("FrozenLake-v1", is_slippery=False, max_turns=20)
    assert env.action_choices == ("L", "D", "R", "U")
    obs, info = env.reset(0)
    assert obs == "PFFF\nFHFH\nFFFH\nHFFG" and json.dumps(info)
    obs2, r, term, _, info = env.step("jump")
    assert obs2 == obs and info["malformed"] == 1 and not info["valid"] and r == 0.0
    for a in ["down", "D", "2", "R", "d", "right"]:  # names, words and indices all parse
        obs, r, term, _trunc, info = env.step(a)
    assert term and r == 1.0 and info["success"] and info["return"] == 1.0 and info["turns"] == 7
    assert obs.endswith("P") and json.dumps(info)
    assert env_return_reward({"info": info}) == {"score": 1.0, "success": True}


def test_gymnasium_deterministic_by_seed():
    def play(seed):
        env = GymnasiumText("FrozenLake-v1", is_slippery=True)  # slippery: the seed drives the dynamics
        out = [env.reset(seed)[0]]
        rng = random.Random(0)
        for _ in range(15):
            obs, _r, term, _trunc, _info = env.step(rng.choice("LDRU"))
            out.append(obs)
            if term:
                break
        return out

    assert play(4) == play(4)
    assert len({tuple(play(s)) for s in range(6)}) > 1
    starts = {GymnasiumText("Taxi-v4").reset(s)[0] for s in range(10)}
    assert len(starts) > 3 and GymnasiumText("Taxi-v4").reset(7) == GymnasiumText("Taxi-v4").reset(7)


def test_gymnasium_taxi_and_cliffwalking_win():
    env = GymnasiumText("Taxi-v4")
    assert env.action_choices == ("south", "north", "east", "west", "pickup", "dropoff")
    obs, _ = env.reset(3)
    assert "\x1b" not in obs and "passenger: R" in obs and "destination: Y" in obs
    for a in ["south", "south", "west", "west", "north", "north", "pickup", "south", "south", "south", "south"]:
        obs, r, term, _, info = env.step(a)
        assert not term
    assert "passenger: taxi" in obs
    obs, r, term, _, info = env.step("Dropoff")
    assert term and r == 20.0 and info["success"] and info["return"] == 9.0
    assert env_return_reward({"info": info}) == {"score": 9.0, "success": True}

    env = GymnasiumText("CliffWalking-v1", max_turns=30)
    assert env.action_choices == ("U", "R", "D", "L")
    obs, _ = env.reset(0)
    assert obs.split("\n")[-1] == "xCCCCCCCCCCT"
    for a in "U" + "R" * 11 + "D":
        obs, r, term, _trunc, info = env.step(a)
    assert term and info["success"] and info["return"] == -13.0  # success = reaching the terminal goal


def test_gymnasium_generic_discrete_env():
    env = GymnasiumText("CartPole-v1", max_turns=3)
    assert env.action_choices == ("0", "1")
    obs, _ = env.reset(0)
    assert obs.startswith("[") and obs == GymnasiumText("CartPole-v1").reset(0)[0]
    assert env.step("2")[4]["malformed"] == 1
    *_, _trunc, info = env.step("1")
    assert info["valid"] and info["return"] == 1.0
    assert env.step("0")[3] is True  # max_turns


# -- TextArena ----------------------------------------------------------------------------
def _guess_the_number(seed: int):
    """Binary search on the game's hints; returns (guesses, last step)."""
    env = TextArenaEnv("GuessTheNumber-v0-train")
    obs, _ = env.reset(seed)
    lo, hi, guesses = 1, 20, []
    while True:
        guess = (lo + hi) // 2
        guesses.append(guess)
        obs, r, term, _trunc, info = env.step(f"[{guess}]")
        if term:
            return guesses, (obs, r, info)
        hint = re.findall(r"The target number is (higher|lower)", obs)[-1]
        lo, hi = (guess + 1, hi) if hint == "higher" else (lo, guess - 1)


def test_textarena_guess_the_number_deterministic_and_won():
    a, b = _guess_the_number(11), _guess_the_number(11)
    assert a == b
    guesses, (_obs, r, info) = a
    assert r == 1.0 and info["success"] and info["return"] == 1.0 and info["turns"] == len(guesses) and info["malformed"] == 0
    assert env_return_reward({"info": info}) == {"score": 1.0, "success": True} and json.dumps(info)
    secrets = {_guess_the_number(s)[0][-1] for s in range(10)}
    assert len(secrets) > 3


def test_textarena_tower_of_hanoi_played_to_the_end_and_invalid_moves():
    env = TextArenaEnv("TowerOfHanoi-v0-train")
    obs, _ = env.reset(0)
    assert "A: [3, 2, 1]" in obs
    obs, r, term, _, info = env.step("hello")
    assert not term and info["malformed"] == 1 and not info["valid"] and r == 0.0
    for move in ["A C", "A B", "C B", "A C", "B A", "B C", "[A C]"]:
        obs, r, term, _, info = env.step(move)
    assert term and r == 1.0 and info["success"] and info["turns"] == 8 and info["malformed"] == 1
    assert "C: [3, 2, 1]" in obs

    env = TextArenaEnv("TowerOfHanoi-v0-train")
    env.reset(0)
    env.step("nope")
    *_, term, _trunc, info = env.step("still nope")  # TextArena ends the game on a second invalid move in a row
    assert term and not info["success"] and info["malformed"] == 2


def test_textarena_rng_isolated_between_envs_and_process():
    def alone(seed):
        env = TextArenaEnv("2048-v0-train")
        out = [env.reset(seed)[0]]
        out += [env.step(a)[0] for a in ["up", "left", "down", "right", "up", "left"]]
        return out

    ref1, ref2 = alone(1), alone(2)
    assert ref1 != ref2
    e1, e2 = TextArenaEnv("2048-v0-train"), TextArenaEnv("2048-v0-train")
    got1, got2 = [e1.reset(1)[0]], [e2.reset(2)[0]]
    random.seed(123)
    for a in ["up", "left", "down", "right", "up", "left"]:
        got1.append(e1.step(a)[0])
        got2.append(e2.step(a)[0])
    assert got1 == ref1 and got2 == ref2  # interleaved play changes nothing
    x = random.random()
    random.seed(123)
    assert random.random() == x  # and the process's own random stream is untouched


def test_textarena_truncation_and_multiplayer_rejected():
    env = TextArenaEnv("TowerOfHanoi-v0", max_turns=2)
    env.reset(0)
    assert env.step("[A B]")[2:4] == (False, False)
    *_, term, trunc, info = env.step("[B A]")
    assert trunc and not term and info["turns"] == 2 and info["valid"]
    with pytest.raises(ValueError, match="not single-player"):
        TextArenaEnv("TicTacToe-v0").reset(0)
