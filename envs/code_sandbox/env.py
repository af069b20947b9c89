"""Code sandbox env: write a small Python function, get hidden-test feedback, retry (SWE-like).

Observation: the function signature with a one-line docstring; on later turns also the result
of the last attempt (tests passed, the first failing case or what stopped the run). Action: the
function's code; a ```python fenced block is taken from free text, and a bare body (no
top-level ``def``) is put under the signature. Each attempt runs in the sandbox against the hidden
tests; the episode terminates when all pass and is truncated after ``max_turns`` attempts.
The env reward of a step is the fraction of tests that attempt passed.

info: success, tests_passed, tests_total, backend, verdict (ok, failed, syntax_error, error,
timeout, memory, process_limit, killed, too_long), turns, seed, family, func.
Constructor arguments are a flow's ``env_args`` (backend: auto|subprocess|docker, max_turns,
families, the limits, image, docker_host). In a flow: ``env: rollart_dask.envs.code_sandbox:CodeSandboxEnv``
and ``reward: rollart_dask.rewards.code:reward``.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from .problems import Problem, make_problem
from .sandbox import Limits, RunResult, make_sandbox

HARNESS = Path(__file__).with_name("harness.py").read_text()
MARK = "@@R "
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(text: str, problem: Problem) -> str:
    """The code in an action: the first fenced block if any; a bare body (no top-level def) goes under the signature."""
    m = FENCE.search(text)
    code = m.group(1) if m else text
    code = code.strip("\n")
    if not re.search(r"^(def|class)\s", code, re.MULTILINE):
        if not code.strip():
            code = "pass"
        if any(line.strip() and not line[0].isspace() for line in code.split("\n")):
            code = "\n".join("    " + line if line.strip() else line for line in code.split("\n"))
        code = problem.signature + "\n" + code
    return code + "\n"


def ascii_text(text: str) -> str:
    """Printable ASCII and newlines only (the observation alphabet of small models)."""
    return "".join(c if (" " <= c <= "~" or c == "\n") else "?" for c in text)


def _short(value, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


class CodeSandboxEnv:
    """Deterministic by seed (the seed picks the problem); see the module docstring."""

    def __init__(
        self,
        backend: str = "auto",
        max_turns: int = 4,
        families: list[str] | None = None,
        cpu_s: int = 2,
        wall_s: float = 5.0,
        memory_mb: int = 512,
        nproc: int = 32,
        fsize_mb: int = 16,
        total_memory_mb: int = 1024,
        scratch_mb: int = 64,
        max_code_chars: int = 4000,
        feedback_chars: int = 160,
        image: str | None = None,
        docker_host: str | None = None,
        scratch_root: str | None = None,
        python: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"code_sandbox max_turns must be >= 1, got {max_turns}")
        self.limits = Limits(
            cpu_s=cpu_s,
            wall_s=wall_s,
            memory_mb=memory_mb,
            nproc=nproc,
            fsize_mb=fsize_mb,
            total_memory_mb=total_memory_mb,
            scratch_mb=scratch_mb,
        )
        self.max_turns, self.families = max_turns, families
        self.max_code_chars, self.feedback_chars = max_code_chars, feedback_chars
        kw = {"image": image} if image else {}
        self.sandbox = make_sandbox(backend, self.limits, scratch_root=scratch_root, docker_host=docker_host, python=python, **kw)
        self.backend = self.sandbox.name
        self.problem: Problem | None = None
        self.turns = 0

    def reset(self, seed: int):
        self.problem = make_problem(seed, self.families)
        self.sandbox.reset_scratch()
        self.turns = 0
        self.success = False
        info = {
            "seed": seed,
            "family": self.problem.family,
            "func": self.problem.func,
            "backend": self.backend,
            "success": False,
            "tests_passed": 0,
            "tests_total": len(self.problem.inputs),
            "verdict": None,
            "turns": 0,
        }
        return self.problem.prompt, info

    def step(self, action: str):
        p = self.problem
        if p is None:
            raise RuntimeError("code_sandbox: step() before reset()")
        self.turns += 1
        total = len(p.inputs)
        if len(action) > self.max_code_chars:
            passed, verdict, feedback, wall = 0, "too_long", f"Code too long ({len(action)} > {self.max_code_chars} chars).", 0.0
        else:
            code = extract_code(action, p)
            cases = json.dumps({"func": p.func, "inputs": p.inputs})
            result = self.sandbox.run({"solution.py": code, "cases.json": cases, "harness.py": HARNESS}, ["python", "harness.py"])
            passed, verdict, feedback = judge(p, result, self.limits)
            wall = result.wall_s
        self.success = passed == total
        terminated = self.success
        truncated = not terminated and self.turns >= self.max_turns
        feedback = ascii_text(f"Tests: {passed}/{total} passed. {feedback}".strip())[: self.feedback_chars]
        obs = p.prompt + "\n# " + feedback.replace("\n", "\n# ")
        info = {
            "seed": p.seed,
            "family": p.family,
            "func": p.func,
            "backend": self.backend,
            "success": self.success,
            "tests_passed": passed,
            "tests_total": total,
            "verdict": verdict,
            "turns": self.turns,
            "wall_s": wall,
        }
        return obs, passed / total, terminated, truncated, info

    def expert_action(self) -> str | None:
        """The problem's reference solution (demonstrations for a warm start)."""
        return None if self.problem is None or self.success else self.problem.reference

    def close(self):
        self.sandbox.close()


def parse_events(output: str) -> list[dict]:
    events = []
    for line in output.splitlines():
        if line.startswith(MARK):
            try:
                event = json.loads(line[len(MARK) :])
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def judge(p: Problem, result: RunResult, limits: Limits) -> tuple[int, str, str]:
    """(tests passed, verdict, feedback) from what the harness reported and how the run ended.

    Outputs are compared with the expected values here: the sandbox only reports outputs.
    """
    events = parse_events(result.output)
    outcome: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "result" and isinstance(e.get("i"), int) and 0 <= e["i"] < len(p.inputs):
            # The code could print such lines too, but only outputs, never a pass: the expected
            # values never enter the sandbox. The first line per test counts.
            outcome.setdefault(e["i"], e)
    passed, first_fail, kinds = 0, None, set()
    for i, expected in enumerate(p.expected):
        e = outcome.get(i)
        if e is None:
            continue
        if "out" in e and e["out"] == json.dumps(expected, sort_keys=True):
            passed += 1
            continue
        kinds.add(e.get("kind"))
        if first_fail is None:
            args = ", ".join(_short(a) for a in p.inputs[i])
            got = f"raised {str(e.get('error', '?'))[:60]}" if "out" not in e else f"returned {_short(_decode(e['out']))}"
            first_fail = f"{p.func}({args}) {got}, expected {_short(expected)}."
    by_event = {e.get("event"): e for e in events}
    if "syntax_error" in by_event:
        return 0, "syntax_error", f"SyntaxError: {by_event['syntax_error'].get('error', '')}"
    if result.oom:
        return passed, "memory", f"Killed: memory limit ({limits.memory_mb} MB)."
    if result.timed_out or result.signal in (signal.SIGXCPU, signal.SIGKILL):
        return passed, "timeout", f"Stopped: time limit ({limits.cpu_s} s CPU, {limits.wall_s:g} s wall)."
    if result.signal is not None:
        try:
            name = signal.Signals(result.signal).name
        except ValueError:
            name = str(result.signal)
        return passed, "killed", f"Killed by signal {name}."
    load = by_event.get("load_error")
    if load is not None:
        kinds.add(load.get("kind"))
    if "memory" in kinds:
        return passed, "memory", f"MemoryError: over the memory limit ({limits.memory_mb} MB)."
    if "process_limit" in kinds:
        return passed, "process_limit", f"Process limit ({limits.nproc}) hit: fork failed."
    if load is not None:
        return 0, "error", f"Error: {load.get('error', '')}"
    if passed == len(p.inputs):
        return passed, "ok", "All passed."
    if "done" not in by_event and first_fail is None:
        return passed, "error", f"The run ended early (exit code {result.exit_code})."
    return passed, "failed", first_fail or ""


def _decode(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value["__repr__"] if isinstance(value, dict) and set(value) == {"__repr__"} else value
