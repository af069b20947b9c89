"""EMULATED reward for system ablations: the env's own outcome (as env_return), after sleeping
the reward cost the synthetic workload drew for the trajectory (``info["reward_s"]``, already
scaled to wall seconds). Stands for a GPU-sized reward — a reward model, a judge — whose cost,
not content, is what the serverless-vs-local ablation measures.

>>> reward({"info": {"success": True, "return": 1.0, "reward_s": 0.0}})
{'score': 1.0, 'success': True, 'emulated': True}
"""

import time


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    time.sleep(max(0.0, float(info.get("reward_s", 0.0))))
    return {"score": float(info.get("return", 0.0)), "success": bool(info.get("success", False)), "emulated": True}


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
