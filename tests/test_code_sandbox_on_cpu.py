"""Code sandbox env, its reward, and the isolation of both sandbox backends.

The isolation tests run against the subprocess backend always, and against the docker backend
when a private dockerd can be started here (session fixture: `dockerd` installed, root); the
image is built from local files by deploy/docker/build-sandbox-image.sh.
"""

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rollart_dask.envs.code_sandbox import (
    FAMILIES,
    CodeSandboxEnv,
    DockerSandbox,
    Limits,
    SandboxUnavailable,
    extract_code,
    make_problem,
    make_sandbox,
)
from rollart_dask.rewards.code import handler, reward

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "docker"
FAST = {"cpu_s": 1, "wall_s": 3.0}  # limits that keep the runaway cases short


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def docker_host():
    """A private dockerd (own data root and socket) with the sandbox image built from local files."""
    from tests.conftest import require

    require("dockerd")  # skipped without Debian's docker.io; a failure in CI on x86-64, where `make test` installs it
    if os.geteuid() != 0:
        pytest.skip("a private dockerd needs root: docker backend not tested")
    pytest.importorskip("docker", reason="the docker SDK is missing (pip install docker)")
    state = tempfile.mkdtemp(prefix="rdk-", dir="/tmp")  # short: unix socket paths are limited to 108 bytes
    try:
        started = subprocess.run([str(DEPLOY / "start-dockerd.sh"), "start", state], capture_output=True, text=True, timeout=90)
        assert started.returncode == 0, f"private dockerd did not start: {started.stderr}"
        host = started.stdout.strip()
        built = subprocess.run(
            [str(DEPLOY / "build-sandbox-image.sh")], capture_output=True, text=True, timeout=300, env={**os.environ, "DOCKER_HOST": host}
        )
        assert built.returncode == 0, f"image build failed: {built.stderr[-2000:]}"
        yield host
    finally:
        subprocess.run([str(DEPLOY / "start-dockerd.sh"), "stop", state], capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(params=["subprocess", "docker"])
def env(request):
    kw = {"docker_host": request.getfixturevalue("docker_host")} if request.param == "docker" else {}
    e = CodeSandboxEnv(backend=request.param, max_turns=3, **FAST, **kw)
    assert e.backend == request.param
    yield e
    e.close()


def solve(env, seed=11):
    """The reference solution of ``seed`` passes: the env (and its sandbox) still work."""
    env.reset(seed)
    obs, r, terminated, truncated, info = env.step(make_problem(seed).reference)
    assert (r, terminated, info["success"], info["verdict"]) == (1.0, True, True, "ok"), obs
    return info


def attempt(env, code, seed=11):
    env.reset(seed)
    t0 = time.monotonic()
    obs, r, terminated, truncated, info = env.step(code)
    return obs, info, time.monotonic() - t0


def run_script(sandbox, code):
    return sandbox.run({"main.py": textwrap.dedent(code)}, ["python", "main.py"])


def leftover_sandbox_processes(env):
    """Sandboxed processes still alive after a run (there must be none)."""
    if env.backend == "docker":
        return env.sandbox.client.containers.list(all=True)
    base = env.sandbox.uid_base
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid >= base:
                found.append(pid)
        except FileNotFoundError:
            pass
    return found


# ------------------------------------------------------------------ problems, env, reward


def test_problems_deterministic_varied_and_short():
    for seed in (0, 7, 123456, 1_000_000, 1_000_017):
        a, b = make_problem(seed), make_problem(seed)
        assert a.to_json() == b.to_json() and a.reference == b.reference
    problems = [make_problem(s) for s in range(300)]
    assert {p.family for p in problems} == set(FAMILIES)
    assert len({json.dumps(p.to_json()) for p in problems}) == 300
    assert len({p.prompt for p in problems}) > 150
    for p in problems:
        assert 40 <= len(p.prompt) <= 300 and all(c == "\n" or " " <= c <= "~" for c in p.prompt), p.prompt
        assert len(p.inputs) == len(p.expected) >= 5
    env = CodeSandboxEnv(backend="subprocess")
    try:
        assert env.reset(1_000_003) == env.reset(1_000_003)  # held-out seeds: deterministic too
    finally:
        env.close()


def test_reference_of_every_family_passes_and_gets_reward_1():
    env = CodeSandboxEnv(backend="subprocess", max_turns=2)
    try:
        for family in FAMILIES:
            env.families = [family]
            obs, info0 = env.reset(5)
            p = make_problem(5, [family])
            assert obs == p.prompt and info0["tests_total"] == len(p.inputs) and info0["family"] == family
            fenced = f"Here it is:\n```python\n{p.reference}```\nDone."
            obs, r, terminated, truncated, info = env.step(fenced)
            assert (r, terminated, truncated) == (1.0, True, False), (family, obs)
            assert info["success"] and info["tests_passed"] == info["tests_total"] and info["verdict"] == "ok"
            assert info["backend"] == "subprocess"
            traj = {"task": "code", "seed": 5, "turns": [{"observation": obs, "action": fenced, "env_reward": r}], "info": info}
            traj = json.loads(json.dumps(traj))  # JSON in/out, as a Lambda handler sees it
            assert reward(traj)["score"] == 1.0 and reward(traj)["success"] is True
            assert handler(traj, None) == reward(traj)
    finally:
        env.close()


def test_wrong_solution_gets_partial_then_zero_and_multi_turn_feedback():
    env = CodeSandboxEnv(backend="subprocess", max_turns=2, families=["clamp"])
    try:
        prompt, _ = env.reset(3)
        obs, r, terminated, truncated, info = env.step("def {}(x):\n    return x\n".format(make_problem(3, ["clamp"]).func))
        assert 0 < r < 1 and not terminated and not truncated and info["verdict"] == "failed"
        assert obs.startswith(prompt) and f"Tests: {info['tests_passed']}/6 passed." in obs and "expected" in obs
        assert reward({"info": info})["score"] == round(info["tests_passed"] / 6, 6) and not reward({"info": info})["success"]
        obs, r, terminated, truncated, info = env.step("return None")  # a bare body goes under the signature
        assert r == 0.0 and truncated and not terminated and info["turns"] == 2
        assert reward({"info": info}) == {"score": 0.0, "success": False, "tests_passed": 0, "tests_total": 6, "verdict": "failed"}
        json.dumps(info)
    finally:
        env.close()


def test_verdicts_for_broken_code():
    env = CodeSandboxEnv(backend="subprocess")
    try:
        for code, verdict in [
            ("def f(:\n", "syntax_error"),
            ("def other(x):\n    return x\n", "error"),
            ("raise KeyError('k')", "failed"),
            ("import os\nos.kill(os.getpid(), 11)", "killed"),
            ("x" * 5000, "too_long"),
        ]:
            obs, info, _ = attempt(env, code)
            assert info["verdict"] == verdict and info["tests_passed"] == 0, (code[:20], obs)
    finally:
        env.close()


def test_extract_code():
    p = make_problem(0)
    assert extract_code(f"text\n```python\n{p.reference}```\nmore", p) == p.reference
    assert extract_code(f"```\n{p.reference}", p) == p.reference  # an unclosed fence (cut-off generation)
    assert extract_code("return 1", p) == f"{p.signature}\n    return 1\n"


def test_reward_needs_the_code_env_info():
    with pytest.raises(ValueError, match="tests_total"):
        reward({"info": {}})


# ------------------------------------------------------------------ isolation (both backends)


def test_no_network(env):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        res = run_script(
            env.sandbox,
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("CONNECTED")
            except OSError as e:
                print("BLOCKED", e)
        """,
        )
        assert "BLOCKED" in res.output and "CONNECTED" not in res.output, res.output
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    solve(env)


def test_writes_only_in_scratch(env):
    tag = f"sandbox-probe-{os.getpid()}-{time.monotonic_ns()}"
    outside = [f"/tmp/{tag}", f"/dev/shm/{tag}", str(REPO / tag), os.path.join(os.path.expanduser("~"), tag), f"/{tag}"]
    res = run_script(
        env.sandbox,
        f"""
        import json
        results = {{}}
        for path in {outside!r} + ["inside.txt"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
                results[path] = "written"
            except OSError as e:
                results[path] = "denied"
        results["read back"] = open("inside.txt").read()
        print(json.dumps(results))
    """,
    )
    results = json.loads(res.output.strip().splitlines()[-1])
    assert (results.pop("inside.txt"), results.pop("read back")) == ("written", "x")
    assert set(results.values()) == {"denied"}, results
    assert not any(os.path.exists(p) for p in outside)
    # docker binds the host's scratch dir; the subprocess sandbox's scratch is a tmpfs that ends with the run
    assert (env.sandbox.scratch / "inside.txt").exists() == (env.backend == "docker")
    solve(env)


def test_infinite_loop_is_stopped(env):
    obs, info, took = attempt(env, "while True:\n    pass\n")  # a bare body: the loop runs in the first test
    assert info["verdict"] == "timeout" and "time limit" in obs and took < FAST["wall_s"] + 3
    assert not leftover_sandbox_processes(env)
    solve(env)


def test_sleeping_code_hits_the_wall_clock(env):
    obs, info, took = attempt(env, "import time\ntime.sleep(60)\n")
    assert info["verdict"] == "timeout" and FAST["wall_s"] - 0.5 < took < FAST["wall_s"] + 3
    solve(env)


def test_fork_bomb_is_stopped(env):
    obs, info, took = attempt(env, "import os\nwhile True:\n    os.fork()\n")
    assert info["verdict"] == "process_limit" and "Process limit" in obs, obs
    assert took < FAST["wall_s"] + 3
    assert not leftover_sandbox_processes(env)
    solve(env)


@pytest.mark.parametrize("code", ["x = bytearray(10 * 1024 ** 3)", "x = b'a' * (10 * 1024 ** 3)"])
def test_10gb_allocation_is_stopped(env, code):
    obs, info, _ = attempt(env, code)
    assert info["verdict"] == "memory" and "memory limit" in obs, obs
    solve(env)


# ------------------------------------------------------------------ backend selection and errors


def test_auto_backend_without_engine_is_subprocess(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    sb = make_sandbox("auto", Limits(**FAST))
    try:
        assert sb.name == "subprocess"
    finally:
        sb.close()
    with pytest.raises(SandboxUnavailable, match="start-dockerd.sh"):
        make_sandbox("docker", docker_host="unix:///nonexistent/docker.sock")


def test_auto_backend_with_engine_is_docker(docker_host):
    env = CodeSandboxEnv(backend="auto", docker_host=docker_host)
    try:
        assert env.backend == "docker" and isinstance(env.sandbox, DockerSandbox)
        assert solve(env)["backend"] == "docker"
    finally:
        env.close()
    with pytest.raises(SandboxUnavailable, match="build-sandbox-image.sh"):
        make_sandbox("docker", docker_host=docker_host, image="rollart-code-sandbox:missing")


def test_unprivileged_user_isolated_or_clear_error(tmp_path):
    """As a non-root user the sandbox uses a user namespace; where that is refused it must say so."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to become another user) and /usr/bin/python3")
    scratch_root = Path(tempfile.mkdtemp(prefix="rcs-nobody-"))
    os.chown(scratch_root, 65534, 65534)
    inner = textwrap.dedent(f"""
        import os, socket
        out = {{}}
        for p in ["/tmp/x", {str(scratch_root / "x")!r}, "inside"]:
            try:
                open(p, "w").write("x"); out[p] = "written"
            except OSError:
                out[p] = "denied"
        try:
            socket.create_connection(("127.0.0.1", 22), timeout=1); out["net"] = "connected"
        except OSError:
            out["net"] = "blocked"
        try:
            while True: os.fork()
        except OSError:
            out["fork"] = "limited"
        print(repr(out))
    """)
    probe = textwrap.dedent(f"""
        import json
        from envs.code_sandbox import SubprocessSandbox, SandboxUnavailable, Limits  # the folder itself: not installed for this uid
        try:
            sb = SubprocessSandbox(Limits(cpu_s=1, wall_s=3), scratch_root={str(scratch_root)!r})
        except SandboxUnavailable as e:
            print(json.dumps({{"unavailable": str(e)}})); raise SystemExit
        res = sb.run({{"main.py": {inner!r}}}, ["python", "main.py"])
        loop = sb.run({{"main.py": "while True: pass"}}, ["python", "main.py"])
        print(json.dumps({{"out": res.output.strip().splitlines()[-1], "loop_signal": loop.signal}}))
        sb.close()
    """)
    proc = subprocess.run(
        ["/usr/bin/python3", "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(scratch_root)},
        user=65534,
        group=65534,
        extra_groups=[],
    )
    shutil.rmtree(scratch_root, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in result:
        assert "user namespaces" in result["unavailable"]
        return
    out = ast.literal_eval(result["out"])
    assert out == {"/tmp/x": "denied", str(scratch_root / "x"): "denied", "inside": "written", "net": "blocked", "fork": "limited"}
    assert result["loop_signal"] in (24, 9)  # SIGXCPU, or SIGKILL at the hard limit


# ------------------------------------------------------------------ containment of the subprocess sandbox


@pytest.fixture
def jail():
    sb = make_sandbox("subprocess", Limits(**FAST))
    yield sb
    sb.close()


def test_no_unix_socket_of_the_host_is_reachable(jail, tmp_path):
    """Read-only mounts do not stop connect(): the sandbox must not see the host's sockets at all."""
    dirs = [Path(tempfile.mkdtemp(dir=d)) for d in ("/var/tmp", os.path.expanduser("~"))] + [tmp_path]
    if os.access("/run", os.W_OK):  # where docker.sock and the session bus live
        dirs.append(Path(tempfile.mkdtemp(dir="/run")))
    servers, paths = [], [str(d / "s.sock") for d in dirs]
    try:
        for path in paths + [f"\0rollart-probe-{os.getpid()}"]:  # an abstract name too: it belongs to the netns
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            if path[0] != "\0":  # open to every uid, as X11's and many daemons' sockets are
                os.chmod(path, 0o777)
                os.chmod(os.path.dirname(path), 0o755)
            s.listen(1)
            s.setblocking(False)
            servers.append(s)
        res = run_script(
            jail,
            f"""
            import json, os, socket
            out = {{}}
            for p in {paths!r} + ["\\0rollart-probe-{os.getpid()}"]:
                try:
                    socket.socket(socket.AF_UNIX).connect(p)
                    out[p] = "connected"
                except OSError as e:
                    out[p] = type(e).__name__
            out["groups"] = os.getgroups() if os.getuid() != {os.getuid()} else "own uid"
            print(json.dumps(out))
        """,
        )
        out = json.loads(res.output.strip().splitlines()[-1])
        assert "connected" not in out.values(), out
        if os.geteuid() == 0:
            assert out["groups"] == [], out  # as root: another uid, with no supplementary group
        for s in servers:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in servers:
            s.close()
        for d in dirs[:2] + dirs[3:]:
            shutil.rmtree(d, ignore_errors=True)


def test_home_is_hidden_even_when_the_interpreter_lives_there(tmp_path):
    home = Path(os.path.expanduser("~"))
    python = os.path.realpath(sys.executable)
    secret = home / f"rollart-secret-{os.getpid()}"
    secret.write_text("token")
    try:
        sandboxes = [make_sandbox("subprocess", Limits(**FAST))]
        if python.startswith(str(home) + "/"):  # pyenv, conda, uv: only the installation may show
            sandboxes.append(make_sandbox("subprocess", Limits(**FAST), python=python))
        for sb in sandboxes:
            try:
                res = run_script(
                    sb,
                    f"""
                    import os, sys
                    try:
                        print("READ", open({str(secret)!r}).read())
                    except OSError as e:
                        print("HIDDEN", type(e).__name__)
                    print(sorted(os.listdir({str(home)!r})) if os.path.isdir({str(home)!r}) else "no home")
                """,
                )
            finally:
                sb.close()
            lines = res.output.strip().splitlines()
            assert lines[0].startswith("HIDDEN"), res.output
            shown = sb.python.startswith(str(home) + "/")
            assert lines[1] == (repr([sb.python[len(str(home)) + 1 :].split("/")[0]]) if shown else "no home"), res.output
    finally:
        secret.unlink()


def test_an_interpreter_installed_at_home_itself_is_refused(tmp_path, monkeypatch):
    """interpreter_dirs shows only the installation, and refuses one that is $HOME (it would show it all)."""
    from rollart_dask.envs.code_sandbox.sandbox import interpreter_dirs

    home = tmp_path / "home"
    for name, prefix in (("pyenv", home / "pyenv"), ("athome", home)):
        exe = home / name / "bin" / "python"
        exe.parent.mkdir(parents=True)
        exe.write_text(f"#!/bin/sh\necho {prefix}\necho {prefix}\n")
        exe.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    assert interpreter_dirs(str(home / "pyenv" / "bin" / "python")) == (str(home / "pyenv"),)
    with pytest.raises(SandboxUnavailable, match=r"\$HOME"):
        interpreter_dirs(str(home / "athome" / "bin" / "python"))


def test_fork_and_allocate_past_the_total_memory_cap():
    sb = make_sandbox("subprocess", Limits(cpu_s=5, wall_s=20.0, memory_mb=400, total_memory_mb=160, nproc=16))
    try:
        res = run_script(
            sb,
            """
            import os, time
            kids = []
            for _ in range(4):  # 4 x 100 MB, each under the per-process limit, 400 MB in all
                pid = os.fork()
                if pid == 0:
                    block = b"a" * (100 << 20)
                    time.sleep(2)
                    os._exit(0)
                kids.append(pid)
            print("children:", [os.waitpid(k, 0)[1] for k in kids])
        """,
        )
    finally:
        sb.close()
    if res.caps == "rlimits":
        pytest.skip("no writable cgroup here: the sandbox has per-process limits only (documented)")
    assert res.oom, res
    assert "children:" not in res.output or "9" in res.output, res.output  # a child was killed (SIGKILL = 9)


def test_filling_the_scratch_stops_at_its_size():
    sb = make_sandbox("subprocess", Limits(**FAST, scratch_mb=8, fsize_mb=4))
    try:
        res = run_script(
            sb,
            """
            import errno
            n = 0
            try:
                while True:
                    with open(f"fill-{n // 4}", "ab") as f:  # 4 MB a file: under the file-size limit
                        f.write(b"x" * (1 << 20))
                    n += 1
            except OSError as e:
                print(n, errno.errorcode[e.errno])
        """,
        )
    finally:
        sb.close()
    mb, err = res.output.split()[-2:]
    assert err == "ENOSPC" and int(mb) < 8, res.output
