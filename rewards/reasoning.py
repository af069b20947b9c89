"""Math reward: the dataset's own verifier on the extracted answer of the last turn.

The env puts the problem entry (question, answer, metadata) in its final info, so the reward
needs nothing but the trajectory: it runs anywhere, a Lambda function included.
"""

from ..envs.reasoning import extract_answer, score

FORMAT_PENALTY = 0.1


def reward(trajectory: dict) -> dict:
    info = trajectory.get("info", {})
    turns = trajectory.get("turns") or []
    entry, dataset = info.get("entry"), info.get("dataset")
    if not entry or not dataset:
        raise ValueError("math reward: the trajectory's info has no 'entry'/'dataset' (was it produced by the math env?)")
    answer = extract_answer(turns[-1]["action"]) if turns else None
    s = score(dataset, answer, entry)
    return {"score": round(s - (FORMAT_PENALTY if answer is None else 0.0), 6), "success": s >= 1.0, "answer": answer}


def handler(event, context):  # the same function as an AWS Lambda handler
    return reward(event)
