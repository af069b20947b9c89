"""Execution environments and the pool of one function: worker processes, cold starts, keep-warm, concurrency.

Each function runs in a pool of worker processes (``_bootstrap.py``), one in-flight invocation
per process like a Lambda execution environment: scaled from zero on demand (a cold start imports
the handler), reused warm, retired after ``keep_warm_s`` idle, capped by the function's reserved
concurrency or the server-wide default (429 beyond). An overrun or dead process is killed and
replaced, the endpoint stays up. Events and results travel as JSON, never pickle.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from rollart_dask.serve.lambda_local.api import FunctionConfig


class PoolHost(Protocol):
    """What a pool reads of the service that owns it (service.LocalLambda)."""

    state_dir: Path
    default_concurrency: int
    started: float
    keep_warm_s: float


BOOTSTRAP = str(Path(__file__).with_name("_bootstrap.py"))
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "SYSTEMROOT")
LOG_ROTATE_BYTES = 64 * 1024 * 1024


class WorkerGone(Exception):
    """The environment's process exited (or broke the protocol) during an invocation."""


class Environment:
    """One execution environment: a worker process that has imported the function's handler."""

    def __init__(self, cfg: FunctionConfig):
        self.code_hex, self.revision = cfg.code_hex, cfg.revision
        self.proc: asyncio.subprocess.Process | None = None
        self.born = self.last_used = time.monotonic()
        self.invocations = 0
        self.dead = False
        self.reaped: asyncio.Future | None = None

    async def start(self, cfg: FunctionConfig, code_dir: Path, region: str, log_fd: int, init_timeout: float) -> tuple[float, bytes | None]:
        """Start the process and import the handler: (init ms, error body or None)."""
        env = {k: os.environ[k] for k in ENV_PASSTHROUGH if k in os.environ}
        env.update({str(k): str(v) for k, v in cfg.environment.items()})
        env.update(
            {
                "LAMBDA_TASK_ROOT": str(code_dir),
                "_HANDLER": cfg.handler,
                "AWS_LAMBDA_FUNCTION_NAME": cfg.name,
                "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
                "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(cfg.memory),
                "AWS_REGION": region,
                "AWS_DEFAULT_REGION": region,
                "AWS_EXECUTION_ENV": f"AWS_Lambda_{cfg.runtime}",
                "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand",
            }
        )
        t0 = time.perf_counter()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            BOOTSTRAP,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            env=env,
            cwd=str(code_dir),
            start_new_session=True,
            limit=1 << 20,
        )  # own session: a kill takes its children too
        try:
            header, body = await asyncio.wait_for(self._read(), init_timeout)
        except asyncio.TimeoutError:
            self.kill()
            err = {"errorMessage": f"Init phase timed out after {init_timeout:.2f} seconds", "errorType": "Runtime.InitTimeout"}
            return (time.perf_counter() - t0) * 1000, json.dumps(err).encode()
        except WorkerGone as e:
            self.kill()
            err = {"errorMessage": f"Runtime exited during init: {e}", "errorType": "Runtime.ExitError"}
            return (time.perf_counter() - t0) * 1000, json.dumps(err).encode()
        init_ms = (time.perf_counter() - t0) * 1000
        if header.get("type") != "ready":
            self.kill()
            return init_ms, body
        return init_ms, None

    async def _read(self) -> tuple[dict, bytes]:
        out = self.proc.stdout
        try:
            line = await out.readline()
            if not line:
                raise WorkerGone(f"exit status {await self.proc.wait()}")
            header = json.loads(line)
            body = await out.readexactly(header["len"]) if header["len"] else b""
        except (asyncio.IncompleteReadError, ValueError, KeyError, ConnectionError) as e:
            raise WorkerGone(str(e) or type(e).__name__) from None
        return header, body

    async def invoke(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        try:
            self.proc.stdin.write(json.dumps({**header, "len": len(payload)}).encode() + b"\n" + payload)
            await self.proc.stdin.drain()
        except (ConnectionError, BrokenPipeError) as e:
            raise WorkerGone(str(e)) from None
        return await self._read()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def kill(self):
        if self.dead:
            return
        self.dead = True
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # lets the transport close once the process is reaped
        self.reaped = asyncio.ensure_future(self.proc.wait())  # reap it: no zombies


@dataclass
class FunctionStats:
    invocations: int = 0
    async_invocations: int = 0
    cold_starts: int = 0
    throttles: int = 0
    errors: int = 0
    timeouts: int = 0
    init_errors: int = 0
    async_dropped: int = 0
    billed_ms: int = 0
    duration_ms: float = 0.0
    init_ms: float = 0.0
    peak_busy: int = 0
    retired_alive_s: float = 0.0  # lifetimes of retired environments (provisioned capacity)


class Throttled(Exception):
    pass


class FunctionPool:
    """The execution environments of one function and its concurrency accounting."""

    def __init__(self, service: PoolHost, cfg: FunctionConfig):
        self.service, self.cfg = service, cfg
        self.idle: list[Environment] = []  # LIFO: the most recent stays warm, the rest age out
        self.envs: set[Environment] = set()
        self.busy = 0  # invocations holding a slot (starting or running)
        self.stats = FunctionStats()
        self.timeline: collections.deque = collections.deque(maxlen=4096)  # (t, busy) at every change
        self.log_path = service.state_dir / "logs" / f"{cfg.name}.log"

    def limit(self) -> int:
        return self.cfg.reserved if self.cfg.reserved is not None else self.service.default_concurrency

    def _mark(self):
        self.stats.peak_busy = max(self.stats.peak_busy, self.busy)
        self.timeline.append((round(time.monotonic() - self.service.started, 3), self.busy))

    def acquire(self) -> Environment | None:
        """A warm environment, or None for a new one (the slot is taken either way); Throttled at the limit."""
        while self.idle:
            env = self.idle.pop()
            if not env.dead and env.code_hex == self.cfg.code_hex and env.revision == self.cfg.revision:
                self.busy += 1
                self._mark()
                return env
            self._discard(env)
        if self.busy >= self.limit():
            self.stats.throttles += 1
            raise Throttled()
        self.busy += 1
        self._mark()
        return None

    def release(self, env: Environment | None, reusable: bool):
        self.busy -= 1
        self._mark()
        if env is None:
            return
        if reusable and not env.dead and env.code_hex == self.cfg.code_hex and env.revision == self.cfg.revision:
            env.last_used = time.monotonic()
            self.idle.append(env)
        else:
            self._discard(env)

    def _discard(self, env: Environment):
        env.kill()
        if env in self.envs:
            self.stats.retired_alive_s += time.monotonic() - env.born
        self.envs.discard(env)

    def log_fd(self) -> int:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > LOG_ROTATE_BYTES:
                self.log_path.replace(self.log_path.with_suffix(".log.1"))
        return os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def reap(self, now: float):
        keep = self.service.keep_warm_s
        alive = []
        for env in self.idle:
            if env.dead or now - env.last_used >= keep:
                self._discard(env)
            else:
                alive.append(env)
        excess = max(0, len(alive) - self.limit())
        for env in alive[:excess]:
            self._discard(env)
        self.idle = alive[excess:]

    def close(self):
        for env in list(self.envs):
            self._discard(env)
        self.idle.clear()

    def snapshot(self) -> dict:
        alive_s = self.stats.retired_alive_s + sum(time.monotonic() - e.born for e in self.envs)
        return {
            **asdict(self.stats),
            "alive_s": round(alive_s, 3),
            "busy": self.busy,
            "idle": len(self.idle),
            "environments": len(self.envs),
            "pids": sorted(e.pid for e in self.envs if e.pid and not e.dead),
            "concurrency_limit": self.limit(),
            "reserved_concurrency": self.cfg.reserved,
            "busy_timeline": list(self.timeline),
        }
