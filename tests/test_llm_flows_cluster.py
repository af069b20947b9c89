"""The real-LM flows as a user runs them (`rollart run`), on tiny budgets: SmolLM2-135M-Instruct with a LoRA adapter on
arithmetic in free text (single turn) and on FrozenLake described in words (several turns). Each trains a few steps: the
adapter's weights move, every held-out call completes, and samples.jsonl holds each turn exactly as the model saw it."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

TINY = [
    "--set",
    "trainer.steps=2",
    "--set",
    "rollout.group_size=4",
    "--set",
    "rollout.batch_groups=2",
    "--set",
    "eval.seeds=6",
    "--set",
    "eval.every=0",
    "--set",
    "observe.progress=false",
]


@pytest.mark.parametrize("flow, task, turns", [("llm_math", "math", 1), ("llm_frozenlake", "frozenlake", 3)])
def test_a_real_lm_flow_trains_its_adapter_and_evaluates_without_a_failed_call(tmp_path, flow, task, turns):
    from safetensors.torch import load_file

    out = tmp_path / flow
    extra = ["--set", f"tasks.{task}.max_turns={turns}"]
    res = subprocess.run(
        [sys.executable, "-m", "rollart_dask.entry.cli", "run", f"flows/{flow}.yaml", "--out", str(out), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [r["eval"][task] for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2 and all(e["complete"] and e["failed_calls"] == 0 and e["completed"] == 6 for e in evals)
    assert [r["version"] for r in rows if r["kind"] == "step"] == [1, 2]

    adapter = load_file(str(out / "checkpoints" / "step-2" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(bool(torch.any(v != 0)) for v in lora_b)  # peft starts B at zero: non-zero B is trained

    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert samples and all(s["task"] == task for s in samples)
    turn = samples[0]["turns"][0]
    roles = [m["role"] for m in turn["messages"]]
    assert roles[-1] == "user" and ("system" in roles) == (flow == "llm_frozenlake")
    from rollart_dask.models.smollm2 import build_smollm2
    from rollart_dask.models.tiny import load_tokenizer

    tok = load_tokenizer(build_smollm2())  # the ids the model saw are its chat template applied to those messages
    assert turn["prompt_ids"] == tok.apply_chat_template(turn["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
