"""The runtime's held-out evaluation against a transformers-only greedy evaluator written here: the same model
directory, the same env and reward, the same seeds. The evaluator loads the model with AutoModelForCausalLM, applies
the tokenizer's chat template to each observation as one user message with the generation prompt, decodes greedily
(with constrained decoding: the logits masked to the tokens that continue an allowed choice) and steps the env. The
two success rates must agree within the binomial (Wilson 95%) interval; the evaluator shares no code with the engine,
so a prompt or decoding the engine renders differently shows here.

Each seed's actions are compared too (the sharper check: both decode greedily in fp32). Tiny model
(flows/quickstart.yaml's, briefly warm-started so that it sometimes succeeds) on FrozenLake, constrained; SmolLM2-135M-
Instruct on one-digit arithmetic, free text (~25 s; its first build, shared with the judge's tests, adds 35–45 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollart_dask.config import load_flow
from rollart_dask.algo.heldout import wilson
from tests.conftest import close, flow_dict, start_run

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = yaml.safe_load((REPO / "flows" / "quickstart.yaml").read_text())
HELD_OUT = 1_000_000
WARM_STEPS = 40


class Choices:
    """A logits processor: each row may only continue one of the allowed choices' token ids; once a choice is whole and
    no longer one continues it, EOS (the engine ends the turn there; a choice that prefixes a longer one ends with EOS)."""

    def __init__(self, options: list[list[int]], start: int, eos: int):
        self.options, self.start, self.eos = options, start, eos

    def __call__(self, input_ids, scores):
        import torch

        masked = torch.full_like(scores, float("-inf"))
        for row, ids in enumerate(input_ids.tolist()):
            out = ids[self.start :]
            if self.eos in out:  # ended: its padding is whatever
                masked[row] = scores[row]
                continue
            live = [o for o in self.options if o[: len(out)] == out]
            allowed = {o[len(out)] for o in live if len(o) > len(out)} | ({self.eos} if any(len(o) == len(out) for o in live) else set())
            masked[row, sorted(allowed)] = scores[row, sorted(allowed)]
        return masked


def greedy_texts(model, tokenizer, prompts: list[list[int]], choices: list[str] | None, max_tokens: int) -> list[str]:
    """Greedy decoding (model.generate) of a batch of prompts, left-padded; with ``choices``, constrained to them."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    processors = LogitsProcessorList(
        [Choices([tokenizer.encode(c, add_special_tokens=False) for c in choices], width, eos)] if choices else []
    )
    config = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors)
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out.tolist()]


def transformers_eval(model_dir: Path, task: dict, seeds: range, constrained: bool, auto_tokenizer: bool = True) -> dict[int, dict]:
    """Outcomes by seed ({success, reward, actions}) of greedy play, transformers only (every live episode's turn decoded
    together). ``auto_tokenizer`` False: the tokenizer exactly as tokenizer.json has it (AutoTokenizer in transformers 5
    replaces the tiny character tokenizer's pre-tokenizer by its model type's: newlines are lost)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from rollart_dask.registry import get_reward, make_env

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run torch: beside them, more threads spin against each other
    try:
        tokenizer = (AutoTokenizer if auto_tokenizer else PreTrainedTokenizerFast).from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        reward = get_reward(task["reward"])
        envs = {s: make_env(task["env"], **task.get("env_args", {})) for s in seeds}
        obs = {s: env.reset(seed=s)[0] for s, env in envs.items()}
        choices = {s: list(getattr(env, "action_choices", None) or []) if constrained else None for s, env in envs.items()}
        turns: dict[int, list] = {s: [] for s in seeds}
        final: dict[int, dict] = {s: {} for s in seeds}
        term: dict[int, bool] = dict.fromkeys(seeds, False)
        live = list(seeds)
        for _ in range(task["max_turns"]):
            by_choices: dict[tuple, list[int]] = {}
            for s in live:
                by_choices.setdefault(tuple(choices[s] or ()), []).append(s)
            actions = {}
            for options, group in by_choices.items():
                prompts = [
                    list(
                        tokenizer.apply_chat_template(
                            [{"role": "user", "content": obs[s]}], tokenize=True, add_generation_prompt=True, return_dict=False
                        )
                    )
                    for s in group
                ]
                actions.update(zip(group, greedy_texts(model, tokenizer, prompts, list(options) or None, task["max_tokens"])))
            for s in list(live):
                nobs, r, term[s], trunc, final[s] = envs[s].step(actions[s])
                turns[s].append({"observation": obs[s], "action": actions[s], "env_reward": float(r)})
                obs[s] = nobs
                if term[s] or trunc:
                    live.remove(s)
            if not live:
                break
        out = {}
        for s in seeds:
            envs[s].close()
            score = reward({"task": task["name"], "seed": s, "turns": turns[s], "info": dict(final[s], truncated=not term[s])})
            score = score if isinstance(score, dict) else {"score": float(score)}
            out[s] = {
                "success": float(score.get("success", score["score"] > 0)),
                "reward": float(score["score"]),
                "actions": [t["action"] for t in turns[s]],
            }
        return out
    finally:
        torch.set_num_threads(threads)


async def runtime_eval(cfg, out: Path, model_dir: Path, checkpoint: bool = False) -> tuple[dict, dict, dict, Path | None]:
    """Run.evaluate at the engines' weights after set-up (the model's own, or a warm start's): figures, outcomes by seed,
    each seed's actions, and (``checkpoint``) those weights as a Hugging Face checkpoint."""
    out.mkdir()
    run, client, cluster = await start_run(cfg, out, model_dir)
    try:
        em, actions = run.services.em, {}
        play = em.run

        async def recording(traj, task, *args, **kw):  # the actions each held-out seed took, to compare seed by seed
            done = await play(traj, task, *args, **kw)
            actions[done.seed] = [t.action for t in done.turns]
            return done

        em.run = recording
        figures = await run.evaluate()
        name = cfg.tasks[0].name
        saved = await run.checkpoint() if checkpoint else None
        return figures[name], run.outcomes[name], actions, saved and Path(saved)
    finally:
        await close(run, client, cluster)


def check_agreement(fig: dict, mine: dict[int, dict], theirs: dict[int, dict], actions: dict[int, list], n: int) -> float:
    assert fig["complete"] and fig["seeds"] == n and sorted(theirs) == sorted(mine), fig
    hits = sum(o["success"] for o in mine.values())
    lo, hi = wilson(hits, n)
    rlo, rhi = fig["success_ci"]
    same = sum(actions[s] == mine[s]["actions"] for s in mine) / n
    print(
        f"runtime {fig['success']:.3f} [{rlo:.3f}, {rhi:.3f}], transformers {hits / n:.3f} [{lo:.3f}, {hi:.3f}]; "
        f"same actions on {same:.0%} of {n} seeds"
    )
    assert lo <= fig["success"] <= hi and rlo <= hits / n <= rhi, (fig, hits / n)
    return same


def test_tiny_model_on_frozenlake_agrees_with_a_transformers_greedy_evaluator(address, tmp_path, run_async):
    from rollart_dask.models.tiny import build_tiny_model

    m = QUICKSTART["model"]
    model_dir = build_tiny_model(tmp_path / "model", m["hidden_size"], m["layers"], m["heads"], m["intermediate_size"], m.get("seed", 0))
    task = dict(QUICKSTART["tasks"][0])
    n = 48
    # a short warm start (imitating the env's expert): the random init always takes one move and never succeeds,
    # which any evaluator would agree with
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "model": m,
                "engine": {"backend": "torch", "constrained": True},
                "tasks": [task],
                "eval.seeds": n,
                "eval.retries": 0,
                "warmstart": {"steps": WARM_STEPS, "episodes": 100, "batch": 32},
            }
        )
    )
    fig, theirs, actions, checkpoint = run_async(runtime_eval(cfg, tmp_path / "run", model_dir, checkpoint=True))
    mine = transformers_eval(checkpoint, task, range(HELD_OUT, HELD_OUT + n), constrained=True, auto_tokenizer=False)
    assert check_agreement(fig, mine, theirs, actions, n) >= 0.9  # fp32 both sides: the same moves, but for a near tie


def test_smollm2_on_arithmetic_agrees_with_a_transformers_greedy_evaluator(address, tmp_path, run_async):
    from rollart_dask.models.prepare import cache_dir
    from rollart_dask.models.smollm2 import ModelUnavailable, build_smollm2

    try:
        model_dir = build_smollm2(cache_dir() / "models")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    task = {
        "name": "math",
        "env": "math",
        "reward": "math",
        "affinity": "decode",
        "max_turns": 1,
        "max_tokens": 24,
        "env_args": {
            "dataset": "basic_arithmetic",
            "dataset_args": {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ["+", "-"],
                "allow_parentheses": False,
                "allow_negation": False,
            },
        },
    }
    n = 24
    cfg = load_flow(
        data=flow_dict(
            **{
                "cluster.scheduler": address,
                "model": {"kind": "smollm2"},
                "engine": {"backend": "torch", "constrained": False},
                "tasks": [task],
                "eval.seeds": n,
                "eval.retries": 0,
            }
        )
    )
    fig, theirs, actions, _ = run_async(runtime_eval(cfg, tmp_path / "run", model_dir), timeout=600)
    mine = transformers_eval(model_dir, task, range(HELD_OUT, HELD_OUT + n), constrained=False)
    assert check_agreement(fig, mine, theirs, actions, n) >= 0.75  # free text: a near tie may turn a later token
