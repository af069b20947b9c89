"""Automatic placement: tasks with ``affinity: auto`` go where their measured profile runs fastest, and
``rollout.pd: auto`` disaggregates prefill and decode (either way) or not, whichever is predicted fastest.

For the first ``placement.profile_steps`` steps an auto task generates on any engine pool while the
``Profiler`` measures it from its own calls: the first prompt's length, each later turn's new tokens
(what the conversation added: the observation) and how much of its prompt repeats the conversation so
far (the prefix a cache keeps: its hit rate), the response lengths and the turns per trajectory.
Response lengths and turns are counted as the turns are *asked* where the request says its length
(EMULATED workloads do): counted as they finish, the first steps would hold the short ones only, the
long ones still generating (or aborted as too stale) — a profile biased short.

At the step boundary after them, the profile becomes a synthetic workload of the same shape and a
predictor (``PREDICTORS``) gives every mapping of the auto tasks (prefill → H800, decode → H20, any →
either; with pd auto also prefill on one pool and decode on the other) its step time on the pools' hardware. The predictor simulates the runtime's policy with calls
that cost nothing; what the runtime itself costs is measured on the steps run so far (every auto task
on any pool, not disaggregated: one of the mappings simulated), and their ratio scales every prediction. The fastest is
taken, printed with its prediction, written to ``OUT/placement.json`` and to the metrics (a
``placement`` row), and the run's summary sets the prediction beside the step time measured from
then on. ``placement.profile_from`` reads an earlier run's profile instead and decides before rollout.
Only emulated flows know their pools' hardware (``emulation.pools``): the predictor is the emulation
tool's simulator, named here as a string.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from rollart_dask.config import FlowConfig, FlowError, PDConfig
from rollart_dask.observe import console, step_gaps
from rollart_dask.registry import Registry

PREDICTORS = Registry("placement predictor", {"emulated": "rollart_dask.emulation.placement:rank_mappings"})
POOL_OF = {"prefill": "H800", "decode": "H20", "any": "H800 or H20"}
TURNS_KEPT = 4000  # per task: a profile needs hundreds of turns, not every one
WARMUP_STEPS = 2  # the run's first steps (start-up) are left out of every measured step time


def common_prefix(a, b) -> int:
    """Leading ids ``a`` and ``b`` share."""
    import numpy as np

    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def fit_lengths(xs: list[int]) -> int | dict:
    """A length spec of the synthetic workload (envs/synthetic.py) for measured lengths: a constant, or the lognormal
    with their median and log-space spread, clipped to what was seen."""
    xs = [max(1, int(x)) for x in xs]
    if min(xs) == max(xs):
        return xs[0]
    logs = [math.log(x) for x in xs]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((v - mu) ** 2 for v in logs) / len(logs))
    return {"median": round(math.exp(mu), 1), "sigma": round(sigma, 3), "min": min(xs), "max": max(xs)}


class Profiler:
    """Per task, what its training calls measure (pure: fed by the env manager's ``on_turn``)."""

    def __init__(self):
        self.active = True  # off once the decision starts: later turns are not its evidence
        self.first: dict[str, list[int]] = {}  # task → first-turn prompt lengths
        self.new: dict[str, list[int]] = {}  # task → later turns' prompt tokens not repeating the conversation so far
        self.out: dict[str, list[int]] = {}  # task → response lengths
        self.prompt: Counter = Counter()  # task → prompt tokens seen
        self.reused: Counter = Counter()  # task → of those, the ones repeating the conversation so far
        self.turns: Counter = Counter()  # task → turns seen (of which ``len(first)`` are first turns)
        self.asked_out: dict[str, list[int]] = {}  # task → response lengths the turns asked for (EMULATED requests say it)
        self.asked_turns: Counter = Counter()  # task → turns asked (of which ``asked_first`` first turns)
        self.asked_first: Counter = Counter()

    def asked(self, task: str, turn: int, emulate: dict | None, max_tokens: int) -> None:
        """A turn is about to generate: with ``emulate`` its response length is known now, whatever happens to it."""
        if not self.active or self.asked_turns[task] >= TURNS_KEPT:
            return
        self.asked_turns[task] += 1
        self.asked_first[task] += turn == 0
        if emulate and emulate.get("output_tokens"):
            self.asked_out.setdefault(task, []).append(min(int(emulate["output_tokens"]), max_tokens))

    def observe(self, task: str, before: list, c) -> None:
        """A turn answered: its prompt against the conversation before it, its response."""
        if not self.active or self.turns[task] >= TURNS_KEPT:
            return
        prompt, response = c.prompt_ids, c.token_ids
        self.turns[task] += 1
        self.prompt[task] += len(prompt)
        self.out.setdefault(task, []).append(len(response))
        if not before:
            self.first.setdefault(task, []).append(len(prompt))
            return
        last = before[-1]
        reused = common_prefix(prompt, [*last.prompt_ids, *last.response_ids])
        self.reused[task] += reused
        self.new.setdefault(task, []).append(len(prompt) - reused)

    def profile(self) -> dict[str, dict]:
        out = {}
        for task, firsts in self.first.items():
            asked = self.asked_out.get(task)
            turns = self.asked_turns[task] / self.asked_first[task] if asked and self.asked_first[task] else self.turns[task] / len(firsts)
            out[task] = {
                "trajectories": len(firsts),
                "turns": turns,
                "lengths_from": "asked" if asked else "answered",
                "prompt_tokens": fit_lengths(firsts),
                "output_tokens": fit_lengths(asked or self.out[task]),
                "obs_tokens": fit_lengths(self.new[task]) if self.new.get(task) else 0,
                "prefix_hit": self.reused[task] / max(self.prompt[task], 1),
            }
        return out


def describe(row: dict, pd_auto: bool = False) -> str:
    """A ranked row or decision in words: where each auto task generates, or the prefill/decode route."""
    if row.get("pd"):
        return f"prefill on {row['pd']['prefill']}, decode on {row['pd']['decode']} (rollout.pd; affinity routes nothing)"
    words = ", ".join(f"{t} → {a} ({POOL_OF[a]})" for t, a in row["mapping"].items())
    return words + ("; " if words and pd_auto else "") + ("not disaggregated (rollout.pd off)" if pd_auto else "")


def profiled_flow(cfg: FlowConfig, profiles: dict[str, dict], steps: int) -> dict:
    """The flow with every profiled task replaced by a synthetic task of its measured shape (the predictor's input).
    Later turns' new tokens stand for the observation: the prefix reuse measured is the cache the workload gets."""
    data = cfg.model_dump(mode="json", exclude={"imports"})
    data["trainer"]["steps"] = steps
    if data["rollout"]["pd"] == "auto":  # (each candidate sets its own)
        data["rollout"]["pd"] = None
    for t in data["tasks"]:
        p = profiles.get(t["name"])
        if p is None:
            if t["env"] != "synthetic":
                raise FlowError(
                    f"placement: task {t['name']} has no measured profile (none of its trajectories generated during "
                    f"placement.profile_steps): raise profile_steps, or give it an affinity"
                )
        else:
            keep = (
                {k: v for k, v in t["env_args"].items() if k in ("success_p", "reward_s", "time_scale")} if t["env"] == "synthetic" else {}
            )
            t["env"], t["reward"] = "synthetic", "emulated"
            t["env_args"] = {
                **keep,
                "turns": max(1, round(p["turns"])),
                "prompt_tokens": p["prompt_tokens"],
                "output_tokens": p["output_tokens"],
                "obs_tokens": p["obs_tokens"],
            }
        if t["affinity"] == "auto":
            t["affinity"] = "any"
    return data


async def attach(cfg: FlowConfig, out: Path, services) -> AutoPlacement | None:
    """The run's placement of its auto tasks and ``rollout.pd: auto`` (None without either): the env manager feeds its profiler."""
    if not any(t.affinity == "auto" for t in cfg.tasks) and cfg.rollout.pd != "auto":
        return None
    placement = AutoPlacement(cfg, out, lambda: Counter(services.proxy.pool_of.values()), services.proxy, placed=services.em.placed)
    services.em.profiler = placement.profiler
    await placement.start()
    return placement


class AutoPlacement:
    """The run's side: profile, decide in a separate process (the simulator would hold the event loop's GIL), apply."""

    def __init__(self, cfg: FlowConfig, out: Path, engine_workers, proxy=None, placed: dict[str, str] | None = None):
        self.cfg, self.out, self.engine_workers = cfg, Path(out), engine_workers  # engine_workers(): pool → engines
        self.placed = {} if placed is None else placed  # auto task → the affinity chosen (the env manager routes by it)
        self.auto = [t for t in cfg.tasks if t.affinity == "auto"]
        self.pd_auto, self.proxy = cfg.rollout.pd == "auto", proxy  # pd auto: the proxy's route is set when decided (off until then)
        self.profiler = Profiler()
        self.decided: dict | None = None  # placement.json's content once applied
        self._deciding: asyncio.Future | None = None
        self._step_done: dict[int, float] = {}  # step number → monotonic time its Train was taken
        self._factor, self._factor_from = 1.0, "none (uncalibrated: no step measured before the decision)"

    @property
    def profiling(self) -> bool:
        return self.decided is None and self._deciding is None

    async def start(self) -> None:
        """``placement.profile_from``: decide from the earlier run's profile before rollout."""
        src = self.cfg.placement.profile_from
        if src is None:
            return
        path = Path(src) / "placement.json" if Path(src).is_dir() else Path(src)
        try:
            earlier = json.loads(path.read_text())
            profile = earlier["profile"]
        except (OSError, KeyError, ValueError) as e:
            raise FlowError(f"placement.profile_from: {path} holds no profile ({e}); give a run directory with placement.json") from None
        self.profiler.active = False
        if earlier.get("runtime_factor"):  # that run's measured cost of the runtime
            self._factor, self._factor_from = float(earlier["runtime_factor"]), f"the run of {path}"
        decision = await self._decide(profile, step=0, source=str(path))
        self._calibrate(decision, None)
        self._apply(decision)

    async def after_step(self, number: int, write) -> None:
        """At each step boundary: start the decision once the profile steps are done; apply it when it is ready."""
        self._step_done[number] = time.monotonic()
        if self.profiling and number >= self.cfg.placement.profile_steps:
            self.profiler.active = False
            self._deciding = asyncio.ensure_future(self._decide(self.profiler.profile(), step=number, source="measured"))
        if self._deciding is not None and self._deciding.done() and number > WARMUP_STEPS:  # (a step past the warm-up calibrates it)
            decision, self._deciding = self._deciding.result(), None
            decision["applied_at_step"] = number
            self._calibrate(decision, self._measured_since(WARMUP_STEPS + 1, number))
            self._apply(decision)
            write(
                {
                    "kind": "placement",
                    "step": number,
                    **{k: decision[k] for k in ("mapping", "pd", "predicted_step_s", "runtime_factor", "ranking")},
                }
            )

    def _gaps(self, first: int, last: int) -> list[float]:
        """Step times (emulated s) of steps ``first``..``last``, each from the one before it."""
        return step_gaps([t for n, t in sorted(self._step_done.items()) if first - 1 <= n <= last], self.cfg.emulation.time_scale)

    def _measured_since(self, first: int, last: int) -> float | None:
        """Mean step time of steps ``first``..``last``; None without any."""
        gaps = self._gaps(first, last)
        return sum(gaps) / len(gaps) if gaps else None

    @staticmethod
    def _calibrate(decision: dict, measured: float | None) -> None:
        """The predictor simulates the policy with calls that cost nothing; the runtime's own cost is measured on the
        mapping the run had until now (every auto task on any pool): the ratio of its measured to its simulated step time
        scales every prediction. None measured (a decision from a profile at start): the earlier run's ratio, or 1."""
        before = next((r for r in decision["ranking"] if not r.get("pd") and all(a == "any" for a in r["mapping"].values())), None)
        if measured is not None and before is not None:
            decision["runtime_factor"], decision["factor_from"] = measured / before["step_s"], "the steps before the switch"
        for r in decision["ranking"]:
            r["predicted_step_s"] = r["step_s"] * decision["runtime_factor"]
        decision["predicted_step_s"] = decision["ranking"][0]["predicted_step_s"]

    async def _decide(self, profile: dict, step: int, source: str) -> dict:
        p = self.cfg.placement
        flow = profiled_flow(self.cfg, profile, p.sim_steps)
        workers = dict(self.engine_workers())
        rank = PREDICTORS.get("emulated")
        t0 = time.monotonic()
        # at the lowest CPU priority: the run's emulated time is wall-clock, and the steps it runs meanwhile calibrate the factor
        with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=os.nice, initargs=(19,)) as pool:
            ranking = await asyncio.get_running_loop().run_in_executor(
                pool, rank, flow, [t.name for t in self.auto], workers, p.sim_seeds, self.pd_auto
            )
        return {
            "mapping": ranking[0]["mapping"],
            "pd": ranking[0].get("pd"),
            "simulated_step_s": ranking[0]["step_s"],
            "ranking": ranking,
            "profile": profile,
            "runtime_factor": self._factor,
            "factor_from": self._factor_from,
            "profiled_at_step": step,
            "profile_source": source,
            "engine_workers": workers,
            "decide_s": time.monotonic() - t0,
        }

    def _apply(self, decision: dict) -> None:
        for t in self.auto:
            self.placed[t.name] = decision["mapping"][t.name]
        if self.pd_auto:  # calls issued from now on take the route (those in flight end where they are)
            self.proxy.pd = PDConfig(**decision["pd"]) if decision["pd"] else None
        self.decided = decision
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "placement.json").write_text(json.dumps(decision, indent=2))
        worst = decision["ranking"][-1]
        console.print(
            "placement (auto): "
            + describe(decision, self.pd_auto)
            + f"; predicted step time {decision['predicted_step_s']:.1f} emulated s ({len(decision['ranking'])} mappings "
            f"simulated on the {decision['profile_source']} profile, × {decision['runtime_factor']:.2f} for the runtime's "
            f"cost measured on {decision['factor_from']}; slowest {worst['predicted_step_s']:.1f} s)"
        )

    def summary(self) -> dict | None:
        """The decision beside the step time measured after it (its first step left out: it began on the old mapping)."""
        if self.decided is None:
            undecided = {"mapping": None, "pd": None, "note": "the run ended before the placement was chosen"}
            return undecided if self.auto or self.pd_auto else None
        d = self.decided
        start = d.get("applied_at_step", 0) + 2  # (the step after the switch began on the old mapping)
        gaps = self._gaps(start, max(self._step_done, default=0))
        measured = sum(gaps) / len(gaps) if gaps else None
        # the mean's standard error: step times vary by tens of percent (heavy-tailed env latencies), so does a few steps' mean
        se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
        return {
            "mapping": d["mapping"],
            "pd": d.get("pd"),
            "predicted_step_s": d["predicted_step_s"],
            "simulated_step_s": d["simulated_step_s"],
            "runtime_factor": d["runtime_factor"],
            "measured_step_s": measured,
            "measured_se_s": se,
            "refit_factor": measured / d["simulated_step_s"] if measured else None,  # the factor the steps after the switch would give
            "steps_measured": sum(1 for n in self._step_done if n >= start),
            "error": (d["predicted_step_s"] - measured) / measured if measured else None,
            "applied_at_step": d.get("applied_at_step", 0),
            "ranking": d["ranking"],
        }
