"""Sokoban reward: 1 for a solved level, else a small partial credit for the fraction of boxes
on targets (at most PARTIAL_CREDIT, well below a solve), minus a format penalty per malformed
action.

>>> reward({"task": "sokoban", "info": {"success": True, "malformed": 0, "boxes_on_target": 1, "boxes": 1}, "turns": []})
{'score': 1.0, 'success': True}
>>> reward({"task": "sokoban", "info": {"success": False, "malformed": 1, "boxes_on_target": 1, "boxes": 2}, "turns": []})
{'score': -0.05, 'success': False}
"""

FORMAT_PENALTY = 0.1
PARTIAL_CREDIT = 0.1


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    success = bool(info.get("success", False))
    if success:
        score = 1.0
    else:
        boxes = int(info.get("boxes", 0))
        score = PARTIAL_CREDIT * int(info.get("boxes_on_target", 0)) / boxes if boxes > 0 else 0.0
    score -= FORMAT_PENALTY * int(info.get("malformed", 0))
    return {"score": round(score, 6), "success": success}


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
