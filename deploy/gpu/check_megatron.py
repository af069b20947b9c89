"""GPU check of the megatron-core trainer backend (one NVIDIA GPU, megatron-core==0.16.1). Under 3 minutes.

What it does, through the product's own code path (rollart_dask.data.trainer_megatron):
  1. builds the tiny Qwen2 model locally (rollart_dask.models.tiny; nothing is downloaded) and a tiny
     Llama (GQA, untied, RoPE base 1e5) from a config: the converted GPTModel's logits on the GPU
     must match the HF model's;
  2. starts MegatronTrainer as a run does (torch.distributed nccl, world size 1, tp=pp=1): a GPTModel
     in Megatron's DDP wrapper, updated by get_megatron_optimizer (Adam, grad clipping inside);
  3. runs a few GRPO steps with the real loss (rollart_dask.algo.losses) on synthetic per-turn
     samples: the first step's loss and grad norm must equal the torch trainer's on the same batch,
     every loss finite, the weights must change;
  4. publishes the weights (Megatron → HF state dict, what engines pull): the keys are the HF
     model's, an HF model loaded with them gives the GPTModel's logits, and HF → Megatron gives back
     the trainer's own tensors exactly; then an HF checkpoint is written and restored.
Prints step times; exits non-zero on any failure.

    python deploy/gpu/check_megatron.py          # on the GPU machine
    python deploy/gpu/check_megatron.py --cpu    # the same steps on CPU (torch AdamW instead of Megatron's optimizer)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

PROMPT = "SFFF\nFPFH\nFFFH\nHFFG\n"


class CheckFailed(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)
    print(f"  ok  {what}", flush=True)


def samples(tokenizer, n: int, seed: int) -> list[dict]:
    """Per-turn samples as the runtime sends them: one of four action tokens, advantages of both signs."""
    import random

    rng = random.Random(seed)
    actions = [tokenizer.convert_tokens_to_ids(c) for c in "LDRU"]
    prompt = tokenizer.encode(PROMPT)
    return [
        {
            "prompt_ids": prompt + tokenizer.encode("F" * rng.randrange(4)),
            "response_ids": [rng.choice(actions)],
            "logprobs": [math.log(0.25)],
            "allowed_ids": [actions],
            "advantage": rng.choice([-1.0, 1.0]),
        }
        for _ in range(n)
    ]


def check_llama_logits(tm, torch, device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=99,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        rope_theta=100000.0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    gpt = tm.build_gpt(config)
    tm.load_megatron_weights(gpt, tm.hf_to_megatron(hf.state_dict(), config))
    gpt.eval()
    ids = torch.randint(0, 99, (4, 32))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = tm.gpt_logits(gpt, ids.to(device), 99).float().cpu()
    check(
        torch.allclose(got, want, atol=2e-3, rtol=2e-3),
        f"Llama GQA GPTModel logits on {device} match HF (max diff {(got - want).abs().max():.2e})",
    )
    back = tm.megatron_to_hf({k: v.cpu() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}, config)
    check(all(torch.equal(back[k], v) for k, v in hf.state_dict().items()), "Llama HF → Megatron → HF round trip exact")
    del gpt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (no GPU asserted; torch AdamW instead of Megatron's optimizer)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: every path takes its CPU branch
    import torch

    from rollart_dask.models.tiny import build_tiny_model
    from rollart_dask.data import trainer_megatron as tm
    from rollart_dask.data.trainer_torch import TorchTrainer

    t_start = time.perf_counter()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="check-megatron-"))
    model_dir = build_tiny_model(tmp, hidden_size=128, layers=2, heads=4, intermediate_size=512, seed=0)

    print("1. trainer start (distributed init, GPTModel, HF → Megatron weights)", flush=True)
    t0 = time.perf_counter()
    trainer = tm.MegatronTrainer(str(model_dir), lr=1e-3, seed=0)
    print(f"     {time.perf_counter() - t0:.1f} s, optimizer {type(trainer.opt).__name__}", flush=True)
    if device == "cuda":
        check(type(trainer.opt).__module__.startswith("megatron"), "Megatron's optimizer drives the update on the GPU")
        check(next(trainer.gpt.parameters()).is_cuda, "GPTModel parameters live on the GPU")
    check_llama_logits(tm, torch, device)
    initial = trainer.state_dict()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check(
        initial.keys() == hf.state_dict().keys() and all(torch.equal(initial[k], v) for k, v in hf.state_dict().items()),
        "published weights before training are the HF model's, key for key",
    )

    print(f"2. {args.steps} GRPO steps", flush=True)
    batches = [samples(trainer.tokenizer, 64, seed=s) for s in range(args.steps)]
    reference = TorchTrainer(str(model_dir), lr=1e-3, seed=0).train_step(batches[0])  # the torch trainer, CPU, same batch
    for step, batch in enumerate(batches):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = trainer.train_step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(
            f"     step {step + 1}: loss {stats['loss']:+.5f}  grad_norm {stats['grad_norm']:.4f}  entropy {stats['entropy']:.4f}  {dt * 1000:.0f} ms",
            flush=True,
        )
        check(math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"]), f"step {step + 1}: loss and grad norm finite")
        if step == 0:
            for key in ("loss", "grad_norm"):
                check(
                    math.isclose(stats[key], reference[key], rel_tol=1e-3, abs_tol=1e-5),
                    f"step 1 {key} {stats[key]:.6f} equals the torch trainer's {reference[key]:.6f} (same GRPO loss)",
                )
    check(trainer.version == args.steps, f"version {trainer.version} after {args.steps} steps")

    print("3. weight publish (Megatron → HF) and round trip", flush=True)
    t0 = time.perf_counter()
    published = trainer.state_dict()
    print(
        f"     state_dict in HF names: {time.perf_counter() - t0:.3f} s, {sum(v.numel() for v in published.values()) / 1e6:.2f} M values",
        flush=True,
    )
    check(published.keys() == initial.keys(), "published keys are the HF model's")
    changed = [k for k in published if not torch.equal(published[k], initial[k])]
    check(len(changed) >= len(published) - 1, f"training changed the weights ({len(changed)}/{len(published)} tensors)")
    own = {k: v.cpu() for k, v in trainer.megatron_state_dict().items()}
    again = tm.hf_to_megatron(published, trainer.hf_config)
    check(again.keys() == own.keys() and all(torch.equal(again[k], own[k]) for k in own), "HF → Megatron of the published weights is exact")
    hf.load_state_dict(published)
    ids = torch.tensor([trainer.tokenizer.encode(PROMPT)] * 2)
    trainer.gpt.eval()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = tm.gpt_logits(trainer.model, ids.to(trainer.device), trainer.hf_config.vocab_size).float().cpu()
    trainer.gpt.train()
    check(
        torch.allclose(got, want, atol=2e-3, rtol=2e-3),
        f"an HF model with the published weights gives the trainer's logits (max diff {(got - want).abs().max():.2e})",
    )

    print("4. HF checkpoint and restore", flush=True)
    path = trainer.save_checkpoint(tmp / "ckpt")
    trainer.train_step(batches[0])
    check(trainer.restore(path) == args.steps, "restore gives back the checkpoint's version")
    restored = trainer.state_dict()
    check(all(torch.equal(restored[k], published[k]) for k in published), "restored weights equal the checkpointed ones")

    print(f"all checks passed in {time.perf_counter() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except CheckFailed as e:
        print(f"FAILED: {e}", file=sys.stderr, flush=True)
        code = 1
    except Exception:
        traceback.print_exc()
        code = 1
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.exit(code)
