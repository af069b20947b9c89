"""Code sandbox reward: the fraction of hidden tests the last attempt passed.

The env's final info carries tests_passed/tests_total (outputs were compared with the expected
values by the env, outside the sandbox), so the reward needs nothing else and runs anywhere.

>>> reward({"task": "code", "info": {"tests_passed": 6, "tests_total": 6, "verdict": "ok"}, "turns": []})
{'score': 1.0, 'success': True, 'tests_passed': 6, 'tests_total': 6, 'verdict': 'ok'}
>>> reward({"task": "code", "info": {"tests_passed": 3, "tests_total": 6, "verdict": "failed"}, "turns": []})["score"]
0.5
"""


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info") or {}
    total = int(info.get("tests_total") or 0)
    if total <= 0:
        raise ValueError("code reward: the trajectory's info has no tests_total (was it produced by the code_sandbox env?)")
    passed = min(max(int(info.get("tests_passed") or 0), 0), total)
    return {
        "score": round(passed / total, 6),
        "success": passed == total,
        "tests_passed": passed,
        "tests_total": total,
        "verdict": info.get("verdict"),
    }


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
