"""Reward from the env's own return: score is ``info["return"]`` (the sum of the env's rewards,
as the adapters in envs.adapters report it), success is ``info["success"]``. No format penalty
here: the wrapped env's own rules already price invalid moves, or not.

>>> reward({"task": "taxi", "info": {"success": True, "return": 7.0, "malformed": 1}, "turns": []})
{'score': 7.0, 'success': True}
>>> reward({"task": "guess", "info": {"success": False, "return": 0.25}, "turns": []})
{'score': 0.25, 'success': False}
"""


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    return {"score": round(float(info.get("return", 0.0)), 6), "success": bool(info.get("success", False))}


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
