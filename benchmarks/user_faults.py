"""The user-fault table: each fault a user's own code or flow values cause, on a real run of the quickstart flow at
tiny scale (`rollart run` as a user runs it, the embedded cluster). For each row: the first line the user saw, how
long the command took to stop (or how many failures it counted and went on), non-finite samples trained and
non-finite versions published (from the run's metrics and its last checkpoint), and whether it hung (no end within
--hang-s). The faulty code: tests/user_code/faults_mod.py.

A second table attacks what runs the model's code and the user's rewards directly: the code-sandbox env's own
sandbox (subprocess backend) runs each attack as a run's program would, and the local Lambda endpoint gets a
deploy POST without its token, as a web page the user visits could send it.

    python benchmarks/user_faults.py                 # ~6 min on 2 cores
    python benchmarks/user_faults.py --only nan      # rows whose name holds 'nan'
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import sys
import time
from pathlib import Path

import click
from rich.table import Table

from rollart_dask.observe import console

REPO = Path(__file__).resolve().parent.parent
MOD = str(REPO / "tests" / "user_code" / "faults_mod.py")
BASE = [
    "trainer.steps=4",
    "rollout.batch_groups=4",
    "eval.every=0",
    "eval.seeds=8",
    "observe.progress=false",
    "trainer.max_minutes=null",
    "trainer.checkpoint_every=1",
    f"imports=[{MOD}]",
]
ROWS = {  # name → (what is wrong, --set overrides)
    "reward-nan-some": ("reward: NaN on some trajectories", ["tasks.frozenlake.reward=faults_mod:nan_on_even_turns"]),
    "reward-inf": ("reward: +inf", ["tasks.frozenlake.reward=faults_mod:inf_later"]),
    "reward-string": ("reward: a string", ["tasks.frozenlake.reward=faults_mod:string_later"]),
    "reward-raises": ("reward: raising always", ["tasks.frozenlake.reward=faults_mod:always_raises"]),
    "reward-raises-later": ("reward: raising on the run's trajectories", ["tasks.frozenlake.reward=faults_mod:raises_later"]),
    "reward-raises-10pct": ("reward: raising on 10% of calls", ["tasks.frozenlake.reward=faults_mod:raises_on_a_tenth"]),
    "env-reset-raises": ("env: raising at reset", ["tasks.frozenlake.env=faults_mod:ResetRaises"]),
    "env-step-raises": ("env: raising at step", ["tasks.frozenlake.env=faults_mod:StepRaisesLater"]),
    "env-step-hangs": (
        "env: hanging in step past its timeout",
        ["tasks.frozenlake.env=faults_mod:StepHangsLater", "rollout.env_timeout_s=2"],
    ),
    "env-obs-not-text": ("env: a non-string observation", ["tasks.frozenlake.env=faults_mod:DictObservationLater"]),
    "env-unknown": ("an unknown env name", ["tasks.frozenlake.env=nosuchenv"]),
    "eval-start-seed-0": ("eval.start_seed: 0", ["eval.start_seed=0"]),
    "weight-inf": ("a task weight: .inf", ["tasks.frozenlake.weight=.inf"]),
    "group-size-1": ("rollout.group_size: 1", ["rollout.group_size=1"]),
}


def play(name: str, overrides: list[str], out: Path, hang_s: float) -> dict:
    cmd = [sys.executable, "-m", "rollart_dask.entry.cli", "run", str(REPO / "flows" / "quickstart.yaml"), "--out", str(out)]
    for o in [*BASE, *overrides]:
        cmd += ["--set", o]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=hang_s, cwd=REPO)
        hung, output, rc = False, proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        hung, output, rc = True, (e.stdout or b"").decode() + (e.stderr or b"").decode(), None
    seconds = time.monotonic() - t0
    said = _error(output)
    rows = _rows(out / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    nonfinite_trained = sum(not all(math.isfinite(r.get(k, 0.0)) for k in ("reward_mean", "loss", "grad_norm")) for r in steps)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    counts = summary.get("counts", {})
    failures = sum(v for k, v in counts.items() if k.startswith("user_faults_"))
    return {
        "name": name,
        "rc": rc,
        "hung": hung,
        "seconds": seconds,
        "said": said,
        "steps": len(steps),
        "failures": failures,
        "nonfinite_trained": nonfinite_trained,
        "nonfinite_published": _nonfinite_checkpoints(out / "checkpoints"),
        "skipped_updates": sum(r.get("nonfinite_skipped", 0) for r in steps),
    }


def _error(output: str) -> str | None:
    """What the command's error said, its first two lines joined (a flow error names the key on its second)."""
    lines = output.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("Error:")), None)
    return None if at is None else " ".join(line.strip() for line in lines[at : at + 2]).removeprefix("Error: ")


def _rows(path: Path) -> list[dict]:
    from rollart_dask.observe import read_rows

    return read_rows(path) if path.exists() else []


def _nonfinite_checkpoints(root: Path) -> int:
    """Checkpoints of the run whose weights hold a NaN or inf (a version published is checkpointed every step here)."""
    import torch
    from safetensors.torch import load_file

    bad = 0
    for d in sorted(root.glob("step-*")) if root.exists() else []:
        for f in d.glob("*.safetensors"):
            bad += any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in load_file(str(f)).values())
    return bad


ATTACKS = {  # name → (what, the program, what it must get); {sock} / {secret} are planted by attack()
    "sandbox-socket": (
        "sandbox: connect to a Unix socket open to every uid (/var/tmp)",
        """
        import socket
        try:
            socket.socket(socket.AF_UNIX).connect({sock!r}); print("connected")
        except OSError as e:
            print("refused:", type(e).__name__)""",
    ),
    "sandbox-home": (
        "sandbox: read a file planted in $HOME",
        """
        try:
            print("read:", open({secret!r}).read())
        except OSError as e:
            print("refused:", type(e).__name__)""",
    ),
    "sandbox-fork-bomb": (
        "sandbox: a fork bomb",
        """
        import os
        n = 0
        try:
            while True:
                os.fork(); n += 1
        except OSError as e:
            print("refused:", type(e).__name__)""",
    ),
    "sandbox-memory": (
        "sandbox: 4 children x 100 MB past a 160 MB total",
        """
        import os, time
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = b"a" * (100 << 20); time.sleep(2); os._exit(0)
            kids.append(pid)
        print("children ended:", [os.waitpid(k, 0)[1] for k in kids])""",
    ),
    "sandbox-scratch-fill": (
        "sandbox: fill the scratch dir (8 MB)",
        """
        import errno
        n = 0
        try:
            while True:
                with open(f"fill-{{n // 4}}", "ab") as f:
                    f.write(b"x" * (1 << 20))
                n += 1
        except OSError as e:
            print(f"refused after {{n}} MB:", errno.errorcode[e.errno])""",
    ),
}


def attack(name: str, program: str) -> dict:
    from rollart_dask.envs.code_sandbox import Limits, make_sandbox

    planted = Path(tempfile.mkdtemp(dir="/var/tmp"))
    os.chmod(planted, 0o755)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(planted / "s.sock"))
    os.chmod(planted / "s.sock", 0o777)
    server.listen(1)
    server.setblocking(False)
    secret = Path(os.path.expanduser("~")) / f"rollart-secret-{os.getpid()}"
    secret.write_text("token")
    sb = make_sandbox("subprocess", Limits(cpu_s=5, wall_s=20.0, memory_mb=400, total_memory_mb=160, nproc=16, scratch_mb=8, fsize_mb=4))
    try:
        res = sb.run({"main.py": textwrap.dedent(program.format(sock=str(planted / "s.sock"), secret=str(secret)))}, ["python", "main.py"])
        try:
            server.accept()
            reached = True
        except BlockingIOError:
            reached = False
    finally:
        sb.close()
        server.close()
        secret.unlink()
        shutil.rmtree(planted, ignore_errors=True)
    got = (res.output.strip().splitlines() or [""])[-1]
    if res.oom:
        got = f"killed by the total memory cap ({res.caps}); {got}".rstrip("; ")
    contained = not reached and not got.startswith(("connected", "read:")) and (name != "sandbox-memory" or res.oom)
    return {"name": name, "said": got[:160], "seconds": res.wall_s, "hung": res.timed_out, "contained": contained, "caps": res.caps}


def endpoint_without_token() -> dict:
    """Deploy a function through the local Lambda endpoint with no token, as a page the user visits could POST."""
    import urllib.error
    import urllib.request

    from rollart_dask.serve.lambda_local import start_local_endpoint

    t0 = time.monotonic()
    with start_local_endpoint(state_dir=tempfile.mkdtemp(prefix="rollart-lambda-")) as ep:
        req = urllib.request.Request(
            ep.url + "/2015-03-31/functions",
            method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"FunctionName": "evil", "Runtime": "python3.12", "Handler": "x.h", "Code": {"ZipFile": ""}}).encode(),
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                status, body = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read().decode()
        deployed = "evil" in json.dumps(ep.stats().get("functions", {}))
    return {
        "name": "endpoint-no-token",
        "said": f"HTTP {status}: {body[:120]}",
        "seconds": time.monotonic() - t0,
        "hung": False,
        "contained": status == 403 and not deployed,
        "caps": "",
    }


def attacks_table(only: str, out: Path) -> list[dict]:
    results = []
    for name, (what, program) in ATTACKS.items():
        if only in name:
            results.append({**attack(name, program), "what": what})
    if only in "endpoint-no-token":
        results.append({**endpoint_without_token(), "what": "endpoint: a deploy POST without the token"})
    if not results:
        return []
    columns = ("attack", "what it got", "stopped after", "contained", "hung")
    cells = [
        [r["what"], r["said"], f"{r['seconds']:.1f} s", "yes" if r["contained"] else "NO", "yes" if r["hung"] else "no"] for r in results
    ]
    table = Table(*columns, title="sandbox and endpoint (attacked directly)")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    out.mkdir(parents=True, exist_ok=True)
    (out / "attacks.json").write_text(json.dumps(results, indent=2))
    (out / "attacks.md").write_text("\n".join(md) + "\n")
    return results


@click.command()
@click.option("--only", default="", help="rows whose name holds this")
@click.option("--out", default="runs/bench-user-faults", show_default=True)
@click.option("--hang-s", default=240.0, show_default=True, help="a command not ended by then hung")
def main(only: str, out: str, hang_s: float) -> None:
    attacks = attacks_table(only, Path(out))
    results = []
    for name, (what, overrides) in ROWS.items():
        if only in name:
            r = play(name, overrides, Path(out) / name, hang_s)
            r["what"] = what
            console.print(f"{name}: rc={r['rc']} {r['seconds']:.0f}s {r['said'] or ''}", markup=False)
            results.append(r)
    if not results:
        return
    columns = (
        "fault",
        "first line the user saw",
        "stopped after / failures counted",
        "non-finite samples trained",
        "non-finite versions published",
        "hung",
    )
    cells = [
        [
            r["what"],
            (r["said"] or "(no error: the run finished)")[:160],
            f"stopped after {r['seconds']:.0f} s"
            if r["rc"]
            else f"ran to the end ({r['steps']} steps, {r['seconds']:.0f} s): {r['failures']} failures counted",
            str(r["nonfinite_trained"]),
            str(r["nonfinite_published"]),
            "yes" if r["hung"] else "no",
        ]
        for r in results
    ]
    table = Table(*columns, title="user faults (tiny quickstart run; `rollart run` as a user runs it)")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "table.json").write_text(json.dumps(results, indent=2))
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    (Path(out) / "table.md").write_text("\n".join(md) + "\n")
    bad = [r["name"] for r in results if r["hung"] or r["nonfinite_trained"] or r["nonfinite_published"]]
    bad += [r["name"] for r in attacks if r["hung"] or not r["contained"]]
    if bad:
        raise SystemExit(f"hung or non-finite: {bad}")


if __name__ == "__main__":
    main()
