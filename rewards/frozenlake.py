"""FrozenLake rewards: 1 for reaching the goal, minus a format penalty per malformed action (``reward``); ``progress``
adds, short of the goal, part of the way covered (a dense signal for a model that rarely reaches it at first).

>>> reward({"task": "frozenlake", "info": {"success": True, "malformed": 0}, "turns": []})
{'score': 1.0, 'success': True}
>>> reward({"task": "frozenlake", "info": {"success": False, "malformed": 2}, "turns": []})
{'score': -0.2, 'success': False}
>>> progress({"task": "frozenlake", "info": {"success": False, "malformed": 0, "distance": 1, "start_distance": 4}, "turns": []})
{'score': 0.375, 'success': False}
>>> progress({"task": "frozenlake", "info": {"success": False, "malformed": 1, "fell": True, "distance": None, "start_distance": 4}, "turns": []})
{'score': -0.1, 'success': False}
"""

FORMAT_PENALTY = 0.1
PROGRESS_WEIGHT = 0.5  # the most a trajectory short of the goal earns: half of reaching it


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    success = bool(info.get("success", False))
    score = (1.0 if success else 0.0) - FORMAT_PENALTY * int(info.get("malformed", 0))
    return {"score": round(score, 6), "success": success}


def progress(trajectory: dict) -> dict:
    """``reward``, plus PROGRESS_WEIGHT × the share of the shortest path to the goal covered by the end (0 after a fall)."""
    info = trajectory.get("info", {})
    out = reward(trajectory)
    start, left = info.get("start_distance"), info.get("distance")
    if not out["success"] and not info.get("fell") and start and left is not None:
        out["score"] = round(out["score"] + PROGRESS_WEIGHT * max(0.0, 1 - left / start), 6)
    return out


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
