"""Sandboxes that run untrusted Python in a scratch dir: a small backend interface, two backends.

``Sandbox.run(files, argv)`` writes ``files`` into the sandbox's scratch dir and runs ``argv``
there (``argv[0] == "python"`` means the sandbox's own interpreter) under ``Limits``. It returns
a ``RunResult``; limits being hit is a result (``timed_out``, ``signal``), never an exception.
``SandboxUnavailable`` means the isolation itself cannot be had on this machine: no backend ever
falls back to running code unisolated.

- ``SubprocessSandbox``: ``_jail.py`` (namespaces, read-only mounts, rlimits, unprivileged uid).
- ``DockerSandbox``: one throwaway container per run through the docker SDK, from the image that
  ``deploy/docker/build-sandbox-image.sh`` builds from local files; never pulls.
- ``make_sandbox(backend="auto")``: docker when an engine answers, else subprocess.
"""

from __future__ import annotations

import functools
import marshal
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("_jail.py")
DEFAULT_IMAGE = "rollart-code-sandbox:latest"
BUILD_HINT = "build it from local files with deploy/docker/build-sandbox-image.sh (no registry is used)"
SANDBOX_UID = 65534  # nobody: the docker backend's user


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be provided here (the message says what is missing)."""


@dataclass
class Limits:
    cpu_s: int = 2  # CPU seconds per run (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later)
    wall_s: float = 5.0  # wall clock per run; the whole process tree is killed
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    nproc: int = 32  # processes in all (a cgroup's pids.max, RLIMIT_NPROC for a uid of its own / container pids limit)
    total_memory_mb: int = 1024  # memory of the whole sandbox, scratch included (its cgroup / container memory)
    scratch_mb: int = 64  # size of the scratch tmpfs (subprocess backend)
    fsize_mb: int = 16  # largest file the code may write, output included
    nofile: int = 64
    output_bytes: int = 65536  # output kept for the caller


@dataclass
class RunResult:
    output: str  # stdout and stderr together, cut at Limits.output_bytes
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    timed_out: bool  # the wall clock ran out (CPU-limit kills show as signal SIGXCPU/SIGKILL)
    wall_s: float
    backend: str
    truncated: bool = False
    oom: bool = False  # killed by the sandbox's total memory cap (its cgroup / the container's limit)
    caps: str = ""  # what capped the sandbox as a whole: "cgroup v2", "cgroup v1", "docker", or "rlimits" alone


class Sandbox:
    """Backend interface. One instance owns one scratch dir (one episode); not thread-safe."""

    name = "base"

    def __init__(self, limits: Limits | None = None, scratch_root: str | None = None):
        self.limits = limits or Limits()
        root = Path(scratch_root or os.path.join(tempfile.gettempdir(), "rollart-code-sandbox"))
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="ep-", dir=root))

    def write_files(self, files: dict[str, str]) -> None:
        """Write files into the scratch dir without following anything a previous run planted there."""
        for rel, text in files.items():
            path = self.scratch / rel
            if path.parent != self.scratch:
                raise ValueError(f"sandbox files go at the top of the scratch dir, got {rel!r}")
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)

    def reset_scratch(self) -> None:
        for entry in self.scratch.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def run(self, files: dict[str, str], argv: list[str]) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _world_usable(path: str) -> bool:
    """Whether an unrelated uid may execute ``path`` (every parent searchable, the file r-x)."""
    p = Path(path)
    try:
        if p.stat().st_mode & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in p.parents)
    except OSError:
        return False


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _default_python() -> str:
    own = os.path.realpath(sys.executable)
    for cand in (own, "/usr/bin/python3", "/usr/local/bin/python3"):
        cand = os.path.realpath(cand)
        # As root the code runs under an unrelated uid; otherwise it keeps ours (user namespace).
        if not _under(cand, "/tmp") and (_world_usable(cand) if os.geteuid() == 0 else os.access(cand, os.X_OK)):
            return cand
    raise SandboxUnavailable(
        f"no Python interpreter that the unprivileged sandbox uid can run ({own} is under a private dir); "
        "install a system python3 (apt-get install -y python3) or pass python=..."
    )


# What the sandbox's own root shows of the host, read-only, besides the interpreter's installation.
# /etc is left out: python -I -S needs none of it.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


@functools.lru_cache(maxsize=None)
def interpreter_dirs(python: str) -> tuple[str, ...]:
    """The directories the sandbox must show for ``python`` to run: its installation, when not a system one.

    pyenv, conda and uv install under $HOME: then only that installation is shown, never $HOME itself.
    """
    got = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if got.returncode != 0:
        raise SandboxUnavailable(f"the sandbox interpreter {python} does not run: {got.stderr[-300:]}")
    dirs = {os.path.realpath(d) for d in got.stdout.split()} | {os.path.dirname(python)}
    home = os.path.realpath(os.path.expanduser("~"))
    for d in dirs:
        if d == "/" or _under(home, d):
            raise SandboxUnavailable(
                f"the sandbox interpreter {python} is installed at {d}, which would show all of "
                f"$HOME ({home}) to the code; pass python=... (a system python3)"
            )
    outside = sorted(d for d in dirs if not any(_under(d, top) for top in SYSTEM_DIRS))
    return tuple(d for d in outside if not any(d != o and _under(d, o) for o in outside))


class SubprocessSandbox(Sandbox):
    """A child process in new namespaces and a root of its own, under a uid that owns nothing; see _jail.py.

    Needs Linux with root, or with unprivileged user namespaces; raises SandboxUnavailable
    (naming what is missing) instead of running anything unisolated. The scratch dir is a
    ``scratch_mb`` tmpfs made fresh for each run from the files given: nothing the code
    writes outlives its run.
    """

    name = "subprocess"

    def __init__(
        self, limits: Limits | None = None, scratch_root: str | None = None, python: str | None = None, uid_base: int = 1_900_000_000
    ):
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailable("the subprocess sandbox needs Linux namespaces; use backend=docker")
        super().__init__(limits, scratch_root)
        self.python = python or _default_python()
        self.uid_base = uid_base
        if _under(self.python, "/tmp"):
            raise SandboxUnavailable(
                f"the sandbox interpreter {self.python} lies under /tmp, which the sandbox replaces; pass python=... (a system python3)"
            )
        self.binds = list(interpreter_dirs(self.python))
        _preflight(self.python, str(self.scratch.parent))

    def run(self, files: dict[str, str], argv: list[str]) -> RunResult:
        self.reset_scratch()  # the host's scratch dir only stages this run's files
        self.write_files(files)
        return _jail_run(self, argv)


_LAUNCHERS: list[subprocess.Popen] = []  # launchers that reported but may not have exited yet
_LAUNCHERS_LOCK = threading.Lock()


def _reap_launchers(proc: subprocess.Popen | None = None) -> None:
    with _LAUNCHERS_LOCK:
        _LAUNCHERS[:] = [p for p in _LAUNCHERS if p.poll() is None]
        if proc is not None:
            _LAUNCHERS.append(proc)


def _jail_run(sb: SubprocessSandbox, argv: list[str]) -> RunResult:
    lim = sb.limits
    argv = [sb.python, "-I", "-S", "-B"] + argv[1:] if argv and argv[0] == "python" else list(argv)
    r, w = os.pipe()
    inside = "/tmp/scratch"
    cfg = {
        "scratch": str(sb.scratch),
        "argv": argv,
        "status_fd": w,
        "wall_s": lim.wall_s,
        "limits": asdict(lim),
        "uid_base": sb.uid_base,
        "binds": list(SYSTEM_DIRS) + sb.binds,
        "env": {"PATH": "/usr/bin:/bin", "HOME": inside, "TMPDIR": inside, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
    }
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(JAIL), marshal.dumps(cfg).hex()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=(w,),
                start_new_session=True,
            )
        finally:
            os.close(w)
        # The launcher reports and closes the pipe once every sandboxed process is gone; its own
        # exit (namespace teardown, tens of ms) is not waited for: a later run reaps it.
        raw = b""
        deadline = time.monotonic() + lim.wall_s + 10
        poller = select.poll()  # not select(): fd numbers can pass 1024 in a busy worker
        poller.register(r, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0 and poller.poll(left * 1000):
            chunk = os.read(r, 65536)
            if not chunk:
                break
            raw += chunk
        os.close(r)
        _reap_launchers(proc)
        if not raw:
            if proc.poll() is None:  # the launcher hung: kill its group (its PID 1 dies with it)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        data = out.read(lim.output_bytes + 1)
    if not raw:
        raise SandboxUnavailable(
            f"the sandbox launcher died without a report (exit {proc.returncode}): {data[-1000:].decode(errors='replace')}"
        )
    status = marshal.loads(raw)
    if not status["ok"]:
        raise SandboxUnavailable(status["error"])
    return RunResult(
        output=data[: lim.output_bytes].decode("utf-8", errors="replace"),
        exit_code=status["exit"],
        signal=status["signal"],
        timed_out=status["timeout"],
        wall_s=round(time.monotonic() - t0, 4),
        backend="subprocess",
        truncated=len(data) > lim.output_bytes,
        oom=status["oom"],
        caps=status["caps"],
    )


@functools.lru_cache(maxsize=None)
def _preflight(python: str, scratch_root: str) -> None:
    """Once per process: prove the isolation works here, or raise with the reason."""
    probe = SubprocessSandbox.__new__(SubprocessSandbox)
    probe.limits, probe.python, probe.uid_base = Limits(), python, 1_900_000_000
    probe.binds = list(interpreter_dirs(python))
    probe.scratch = Path(tempfile.mkdtemp(prefix="preflight-", dir=scratch_root))
    try:
        res = _jail_run(probe, ["python", "-c", "print('ok')"])
    finally:
        shutil.rmtree(probe.scratch, ignore_errors=True)
    if res.exit_code != 0 or res.output.strip() != "ok":
        raise SandboxUnavailable(f"the subprocess sandbox could not run {python} isolated: {res.output[-500:]!r}")


# ---------------------------------------------------------------- docker


def docker_client(docker_host: str | None = None, timeout: float = 10):
    """A docker SDK client whose engine answered a ping, or None (no SDK, no engine)."""
    try:
        import docker
    except ImportError:
        return None
    client = None
    try:
        client = docker.DockerClient(base_url=docker_host, timeout=timeout) if docker_host else docker.from_env(timeout=timeout)
        client.ping()
        return client
    except Exception:  # noqa: BLE001 - unreachable engine, whatever the transport says
        if client is not None:
            client.close()
        return None


# RLIMIT_AS cannot be a container ulimit (the runtime's own init would run under it and fail),
# and the memory cgroup alone lets an untouched 10 GB allocation succeed: python sets it itself
# before running the command ("python SCRIPT ARGS" or "python -c CODE ARGS").
_AS_PRELUDE = """import resource, sys
n = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_AS, (n, n))
if sys.argv[1] == "-c":
    code = sys.argv.pop(2)
    del sys.argv[0]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
else:
    import runpy
    del sys.argv[0]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


class DockerSandbox(Sandbox):
    """One container per run: no network, read-only root, the scratch dir mounted rw, limits.

    The engine must see this machine's scratch dir (a local engine). The image is never pulled.
    """

    name = "docker"

    def __init__(
        self,
        limits: Limits | None = None,
        scratch_root: str | None = None,
        image: str = DEFAULT_IMAGE,
        docker_host: str | None = None,
        python: str = "/usr/bin/python3",
        init: bool = True,
    ):
        self.client = docker_client(docker_host)
        if self.client is None:
            where = docker_host or os.environ.get("DOCKER_HOST") or "the default socket"
            raise SandboxUnavailable(
                f"no Docker engine answers at {where} (or the docker SDK is missing: pip install docker); "
                "start one (deploy/docker/start-dockerd.sh) or use backend=subprocess"
            )
        import docker

        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            self.client.close()
            raise SandboxUnavailable(f"docker image {image!r} is missing; {BUILD_HINT}") from None
        super().__init__(limits, scratch_root)
        self.image, self.python, self.init = image, python, init

    def run(self, files: dict[str, str], argv: list[str]) -> RunResult:
        import docker
        import requests
        from docker.types import Ulimit

        self.write_files(files)
        # The container's uid must own the scratch dir; as non-root we cannot chown, so open it up.
        for d, dirs, names in os.walk(self.scratch):
            for p in [d] + [os.path.join(d, n) for n in dirs + names]:
                if os.geteuid() == 0:
                    os.lchown(p, SANDBOX_UID, SANDBOX_UID)
                elif not os.path.islink(p):
                    os.chmod(p, os.stat(p).st_mode | (0o777 if stat.S_ISDIR(os.stat(p).st_mode) else 0o666))
        lim = self.limits
        work = "/scratch"
        if argv and argv[0] == "python":
            argv = [self.python, "-I", "-S", "-B", "-c", _AS_PRELUDE, str(lim.memory_mb * 1024 * 1024)] + argv[1:]
        mb = 1024 * 1024
        t0 = time.monotonic()
        container = self.client.containers.create(
            self.image,
            argv,
            user=f"{SANDBOX_UID}:{SANDBOX_UID}",
            working_dir=work,
            environment={"HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
            network_mode="none",
            ipc_mode="none",  # no network; no /dev/shm at all
            read_only=True,
            volumes={str(self.scratch): {"bind": work, "mode": "rw"}},
            mem_limit=lim.total_memory_mb * mb,
            memswap_limit=lim.total_memory_mb * mb,
            pids_limit=lim.nproc,
            nano_cpus=1_000_000_000,
            ulimits=[
                Ulimit(name="cpu", soft=lim.cpu_s, hard=lim.cpu_s + 1),
                Ulimit(name="fsize", soft=lim.fsize_mb * mb, hard=lim.fsize_mb * mb),
                Ulimit(name="nofile", soft=lim.nofile, hard=lim.nofile),
                Ulimit(name="core", soft=0, hard=0),
            ],
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            hostname="sandbox",
            init=self.init,  # the engine's tini as PID 1: PID 1 itself would ignore SIGXCPU
            log_config={"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}},
        )  # bounded output
        timed_out = False
        try:
            container.start()
            try:
                code = container.wait(timeout=lim.wall_s)["StatusCode"]
            except requests.exceptions.RequestException:  # the SDK's wait timeout is a transport timeout
                timed_out = True
                try:
                    container.kill()
                except docker.errors.APIError:  # it ended meanwhile
                    pass
                code = container.wait(timeout=30)["StatusCode"]
            state = self.client.api.inspect_container(container.id)["State"]
            data = container.logs(stdout=True, stderr=True)[: lim.output_bytes + 1]
        finally:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                pass
        sig = None
        if timed_out or state.get("OOMKilled"):
            sig = signal.SIGKILL
        elif code > 128:  # the engine reports a signal death as 128 + signal
            sig = code - 128
        return RunResult(
            output=data[: lim.output_bytes].decode("utf-8", errors="replace"),
            exit_code=None if sig else code,
            signal=sig,
            timed_out=timed_out,
            wall_s=round(time.monotonic() - t0, 4),
            backend="docker",
            truncated=len(data) > lim.output_bytes,
            oom=bool(state.get("OOMKilled")) and not timed_out,
            caps="docker",
        )

    def close(self) -> None:
        super().close()
        self.client.close()


def make_sandbox(
    backend: str = "auto",
    limits: Limits | None = None,
    scratch_root: str | None = None,
    image: str = DEFAULT_IMAGE,
    docker_host: str | None = None,
    python: str | None = None,
) -> Sandbox:
    """``auto``: docker when an engine answers (its image must exist), else subprocess."""
    if backend == "auto":
        probe = docker_client(docker_host, timeout=2)
        backend = "docker" if probe is not None else "subprocess"
        if probe is not None:
            probe.close()
    if backend == "docker":
        kw = {"python": python} if python else {}
        return DockerSandbox(limits, scratch_root, image=image, docker_host=docker_host, **kw)
    if backend == "subprocess":
        return SubprocessSandbox(limits, scratch_root, python=python)
    raise ValueError(f"unknown sandbox backend {backend!r}; use auto, subprocess or docker")
