"""FrozenLake reward: 1 for reaching the goal, minus a format penalty per malformed action.

>>> reward({"task": "frozenlake", "info": {"success": True, "malformed": 0}, "turns": []})
{'score': 1.0, 'success': True}
>>> reward({"task": "frozenlake", "info": {"success": False, "malformed": 2}, "turns": []})
{'score': -0.2, 'success': False}
"""
FORMAT_PENALTY = 0.1


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    success = bool(info.get("success", False))
    score = (1.0 if success else 0.0) - FORMAT_PENALTY * int(info.get("malformed", 0))
    return {"score": round(score, 6), "success": success}


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
