"""A local endpoint that speaks the AWS Lambda API, so the same boto3 code runs rewards here or on AWS.

Invoke (RequestResponse, Event, DryRun), CreateFunction, UpdateFunctionCode,
UpdateFunctionConfiguration, GetFunction, GetFunctionConfiguration, ListFunctions,
DeleteFunction and Put/Get/DeleteFunctionConcurrency, with the status codes, headers and error
shapes botocore's restJson1 model for Lambda expects. Only ``$LATEST`` exists (no versions or
aliases).

Each function runs in a pool of worker processes (``_bootstrap.py``), one in-flight invocation
per process like a Lambda execution environment: scaled from zero on demand (a cold start imports
the handler), reused warm, retired after ``keep_warm_s`` idle, capped by the function's reserved
concurrency or the server-wide default (429 beyond). A handler that raises, exits or overruns its
Timeout yields ``X-Amz-Function-Error: Unhandled``; an overrun or dead process is killed and
replaced, the endpoint stays up. Events and results travel as JSON, never pickle.

Auth: loopback binds need none. A non-loopback bind requires a token; every request must then be
SigV4-signed with the token as the AWS secret access key (any access key id), verified here with
botocore's own signer, so plain boto3/AWS CLI usage works unchanged. ``/_local/*`` also accepts
``Authorization: Bearer <token>`` (for curl); ``/_local/health`` is open.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import datetime as dt
import hashlib
import hmac
import io
import ipaddress
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiohttp import web

from .client import TOKEN_ENV

log = logging.getLogger(__name__)
ACCOUNT = "000000000000"
MAX_SYNC_PAYLOAD = 6 * 1024 * 1024  # 6291456 bytes, Lambda's synchronous request/response quota
MAX_ASYNC_PAYLOAD = 1024 * 1024  # Lambda's asynchronous (Event) quota
MAX_ZIP = 50 * 1024 * 1024  # direct-upload zip quota
MAX_UNZIPPED = 250 * 1024 * 1024
MAX_REQUEST = MAX_ZIP * 4 // 3 + 64 * 1024  # base64 of the largest zip plus the JSON around it
MIN_TOKEN_LEN = 16
SIGV4_SKEW_S = 300
BOOTSTRAP = str(Path(__file__).with_name("_bootstrap.py"))
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ARN_RE = re.compile(r"^arn:aws[a-zA-Z-]*:lambda:[a-z0-9-]+:\d{12}:function:([A-Za-z0-9_-]{1,64})(?::([$A-Za-z0-9_-]+))?$")
SIGV4_RE = re.compile(r"^AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
                      r"SignedHeaders=([a-z0-9;_.-]+),\s*Signature=([0-9a-f]{64})$")
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "SYSTEMROOT")
LOG_ROTATE_BYTES = 64 * 1024 * 1024
_KEY = getattr(web, "RequestKey", None)  # typed request keys where aiohttp has them (>= 3.13)
REQUEST_ID = _KEY("request_id", str) if _KEY else "request_id"
BODY = _KEY("body", bytes) if _KEY else "body"


class LambdaError(Exception):
    """An API error in the shape botocore parses: status, x-amzn-ErrorType and a JSON body."""

    def __init__(self, status: int, code: str, message: str, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra

    def response(self, request_id: str) -> web.Response:
        key = "Message" if self.code == "ResourceNotFoundException" else "message"  # as in the service model
        body = {"Type": "User" if self.status < 500 else "Service", key: self.message, **self.extra}
        return web.json_response(body, status=self.status, headers={"x-amzn-ErrorType": self.code, "x-amzn-RequestId": request_id})


def not_found(arn: str) -> LambdaError:
    return LambdaError(404, "ResourceNotFoundException", f"Function not found: {arn}")


def invalid(message: str) -> LambdaError:
    return LambdaError(400, "InvalidParameterValueException", message)


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+0000"


@dataclass
class FunctionConfig:
    name: str
    runtime: str
    handler: str
    role: str
    code_hex: str
    code_size: int
    timeout: int = 3
    memory: int = 128
    environment: dict = field(default_factory=dict)
    description: str = ""
    reserved: int | None = None
    last_modified: str = field(default_factory=_now_iso)
    revision: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def code_sha256(self) -> str:  # Lambda reports the base64 of the zip's SHA-256
        return base64.b64encode(bytes.fromhex(self.code_hex)).decode()

    def arn(self, region: str) -> str:
        return f"arn:aws:lambda:{region}:{ACCOUNT}:function:{self.name}"

    def to_api(self, region: str) -> dict:
        return {"FunctionName": self.name, "FunctionArn": self.arn(region), "Runtime": self.runtime, "Role": self.role,
                "Handler": self.handler, "CodeSize": self.code_size, "Description": self.description, "Timeout": self.timeout,
                "MemorySize": self.memory, "LastModified": self.last_modified, "CodeSha256": self.code_sha256,
                "Version": "$LATEST", "Environment": {"Variables": dict(self.environment)},
                "TracingConfig": {"Mode": "PassThrough"}, "RevisionId": self.revision, "State": "Active",
                "LastUpdateStatus": "Successful", "PackageType": "Zip", "Architectures": ["x86_64"],
                "EphemeralStorage": {"Size": 512}}


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
        env.update({"LAMBDA_TASK_ROOT": str(code_dir), "_HANDLER": cfg.handler, "AWS_LAMBDA_FUNCTION_NAME": cfg.name,
                    "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST", "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(cfg.memory),
                    "AWS_REGION": region, "AWS_DEFAULT_REGION": region, "AWS_EXECUTION_ENV": f"AWS_Lambda_{cfg.runtime}",
                    "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand"})
        t0 = time.perf_counter()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, BOOTSTRAP, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fd, env=env,
            cwd=str(code_dir), start_new_session=True, limit=1 << 20)  # own session: a kill takes its children too
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

    def __init__(self, service: LocalLambda, cfg: FunctionConfig):
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
        return {**asdict(self.stats), "alive_s": round(alive_s, 3), "busy": self.busy, "idle": len(self.idle), "environments": len(self.envs),
                "pids": sorted(e.pid for e in self.envs if e.pid and not e.dead), "concurrency_limit": self.limit(),
                "reserved_concurrency": self.cfg.reserved, "busy_timeline": list(self.timeline)}


@dataclass
class Outcome:
    status: int
    body: bytes
    headers: dict


class LocalLambda:
    """The functions, their code and their pools; the HTTP layer is a thin shell around it."""

    def __init__(self, state_dir: Path, region: str = "us-east-1", keep_warm_s: float = 300.0,
                 default_concurrency: int | None = None, init_timeout_s: float = 10.0, max_event_age_s: float = 60.0):
        self.state_dir = Path(state_dir).resolve()  # file URIs in GetFunction need an absolute path
        self.region, self.keep_warm_s, self.init_timeout_s, self.max_event_age_s = region, keep_warm_s, init_timeout_s, max_event_age_s
        self.default_concurrency = default_concurrency or 2 * (os.cpu_count() or 1)
        self.pools: dict[str, FunctionPool] = {}
        self.started = time.monotonic()
        self.requests = 0
        self.auth_failures = 0
        self._tasks: set[asyncio.Task] = set()
        for sub in ("functions", "code", "logs"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        for path in sorted((self.state_dir / "functions").glob("*.json")):  # deployed functions survive restarts
            with contextlib.suppress(ValueError, TypeError, OSError):
                cfg = FunctionConfig(**json.loads(path.read_text()))
                if (self.state_dir / "code" / cfg.code_hex).is_dir():
                    self.pools[cfg.name] = FunctionPool(self, cfg)

    # --- names and storage ---------------------------------------------------------------------

    def resolve(self, ref: str, qualifier: str | None = None) -> FunctionPool:
        name, qual = ref, None
        m = ARN_RE.match(ref)
        if m:
            name, qual = m.group(1), m.group(2)
        elif ":" in ref:
            name, _, qual = ref.partition(":")
        if qualifier and qual and qualifier != qual:
            raise invalid("The derived qualifier from the function name does not match the specified qualifier.")
        qual = qualifier or qual
        arn = f"arn:aws:lambda:{self.region}:{ACCOUNT}:function:{name}" + (f":{qual}" if qual else "")
        if not NAME_RE.match(name):
            raise invalid(f"1 validation error detected: Value '{ref}' at 'functionName' failed to satisfy constraint")
        if name not in self.pools or qual not in (None, "$LATEST"):
            raise not_found(arn)
        return self.pools[name]

    def _store_code(self, zip_b64) -> tuple[str, int]:
        if not isinstance(zip_b64, str) or not zip_b64:
            raise invalid("Code.ZipFile is required (S3 and image code are not supported by the local endpoint)")
        try:
            data = base64.b64decode(zip_b64, validate=True)
        except ValueError:
            raise invalid("Code.ZipFile is not valid base64") from None
        if len(data) > MAX_ZIP:
            raise LambdaError(413, "RequestEntityTooLargeException", f"Zipped size must be smaller than {MAX_ZIP} bytes")
        digest = hashlib.sha256(data).hexdigest()
        target = self.state_dir / "code" / digest
        if not target.is_dir():
            tmp = Path(tempfile.mkdtemp(dir=self.state_dir / "code", prefix=".tmp-"))
            try:
                self._unzip(data, tmp)
                (self.state_dir / "code" / f"{digest}.zip").write_bytes(data)
                try:
                    tmp.rename(target)
                except OSError:  # the same code stored concurrently
                    shutil.rmtree(tmp, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return digest, len(data)

    async def _store_code_async(self, zip_b64) -> tuple[str, int]:
        # Decoding and unzipping are blocking: keep the loop serving invocations meanwhile.
        return await asyncio.get_running_loop().run_in_executor(None, self._store_code, zip_b64)

    @staticmethod
    def _unzip(data: bytes, dest: Path):
        try:
            zf = zipfile.ZipFile(io.BytesIO(data))
            infos = zf.infolist()
        except (zipfile.BadZipFile, ValueError):
            raise invalid("Could not unzip uploaded file. Please check your file, then try to upload again.") from None
        if sum(i.file_size for i in infos) > MAX_UNZIPPED:
            raise invalid(f"Unzipped size must be smaller than {MAX_UNZIPPED} bytes")
        root = dest.resolve()
        for info in infos:
            path = (dest / info.filename).resolve()
            if root != path and root not in path.parents:  # zip-slip
                raise invalid(f"Could not unzip uploaded file: entry {info.filename!r} escapes the archive root")
            if (info.external_attr >> 16) & 0o170000 == 0o120000:
                raise invalid(f"Could not unzip uploaded file: entry {info.filename!r} is a symbolic link")
        zf.extractall(dest)

    def _save(self, cfg: FunctionConfig):
        path = self.state_dir / "functions" / f"{cfg.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(cfg)))
        tmp.replace(path)

    # --- management ----------------------------------------------------------------------------

    @staticmethod
    def _config_fields(body: dict, cfg: FunctionConfig | None) -> dict:
        out = {}
        if "Runtime" in body:
            if not str(body["Runtime"]).startswith("python"):
                raise invalid(f"The local endpoint runs Python handlers only, not runtime {body['Runtime']!r}")
            out["runtime"] = body["Runtime"]
        if "Handler" in body:
            out["handler"] = str(body["Handler"])
        if "Role" in body:
            out["role"] = str(body["Role"])
        if "Timeout" in body:
            t = body["Timeout"]
            if not isinstance(t, int) or not 1 <= t <= 900:
                raise invalid(f"Timeout must be an integer from 1 to 900, got {t!r}")
            out["timeout"] = t
        if "MemorySize" in body:
            m = body["MemorySize"]
            if not isinstance(m, int) or not 128 <= m <= 10240:
                raise invalid(f"MemorySize must be an integer from 128 to 10240, got {m!r}")
            out["memory"] = m
        if "Environment" in body:
            variables = (body["Environment"] or {}).get("Variables") or {}
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items()):
                raise invalid("Environment.Variables must map strings to strings")
            out["environment"] = dict(variables)
        if "Description" in body:
            out["description"] = str(body["Description"])
        return out

    async def create_function(self, body: dict) -> dict:
        ref = body.get("FunctionName") or ""
        m = ARN_RE.match(ref)
        name = m.group(1) if m else ref
        if not NAME_RE.match(name):
            raise invalid(f"Invalid FunctionName {ref!r}")
        for required in ("Role", "Handler", "Runtime"):
            if not body.get(required):
                raise invalid(f"{required} is required")
        if (body.get("PackageType") or "Zip") != "Zip":
            raise invalid("The local endpoint supports PackageType Zip only")
        if name in self.pools:
            raise LambdaError(409, "ResourceConflictException", f"Function already exist: {name}")
        fields = self._config_fields(body, None)
        code_hex, size = await self._store_code_async((body.get("Code") or {}).get("ZipFile"))
        if name in self.pools:  # created while the code was unzipped
            raise LambdaError(409, "ResourceConflictException", f"Function already exist: {name}")
        cfg = FunctionConfig(name=name, code_hex=code_hex, code_size=size, **fields)
        self._save(cfg)
        self.pools[name] = FunctionPool(self, cfg)
        return cfg.to_api(self.region)

    async def update_code(self, ref: str, body: dict) -> dict:
        self.resolve(ref)
        code_hex, size = await self._store_code_async(body.get("ZipFile"))
        pool = self.resolve(ref)
        pool.cfg.code_hex, pool.cfg.code_size = code_hex, size
        pool.cfg.last_modified, pool.cfg.revision = _now_iso(), str(uuid.uuid4())
        self._save(pool.cfg)
        pool.reap(time.monotonic())  # idle environments of the old code go now, busy ones on release
        return pool.cfg.to_api(self.region)

    def update_configuration(self, ref: str, body: dict) -> dict:
        pool = self.resolve(ref)
        for k, v in self._config_fields(body, pool.cfg).items():
            setattr(pool.cfg, k, v)
        pool.cfg.last_modified, pool.cfg.revision = _now_iso(), str(uuid.uuid4())
        self._save(pool.cfg)
        pool.reap(time.monotonic())
        return pool.cfg.to_api(self.region)

    def get_function(self, ref: str, qualifier: str | None) -> dict:
        pool = self.resolve(ref, qualifier)
        out = {"Configuration": pool.cfg.to_api(self.region),
               "Code": {"RepositoryType": "S3", "Location": (self.state_dir / "code" / f"{pool.cfg.code_hex}.zip").as_uri()},
               "Tags": {}}
        if pool.cfg.reserved is not None:
            out["Concurrency"] = {"ReservedConcurrentExecutions": pool.cfg.reserved}
        return out

    def delete_function(self, ref: str, qualifier: str | None):
        pool = self.resolve(ref, qualifier)
        del self.pools[pool.cfg.name]
        pool.close()
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / "functions" / f"{pool.cfg.name}.json").unlink()

    def put_concurrency(self, ref: str, body: dict) -> dict:
        pool = self.resolve(ref)
        n = body.get("ReservedConcurrentExecutions")
        if not isinstance(n, int) or n < 0:
            raise invalid(f"ReservedConcurrentExecutions must be a non-negative integer, got {n!r}")
        pool.cfg.reserved = n
        self._save(pool.cfg)
        pool.reap(time.monotonic())
        return {"ReservedConcurrentExecutions": n}

    def delete_concurrency(self, ref: str):
        pool = self.resolve(ref)
        pool.cfg.reserved = None
        self._save(pool.cfg)

    # --- invocation ----------------------------------------------------------------------------

    async def _run(self, pool: FunctionPool, payload: bytes, request_id: str) -> tuple[dict, bytes, dict]:
        """One invocation on one environment (the slot is held): (result header, body, report)."""
        cfg = pool.cfg
        env = pool.acquire()
        report = {"cold": env is None, "init_ms": 0.0}
        reusable = False
        try:
            if env is None:
                env = Environment(cfg)
                pool.envs.add(env)
                fd = pool.log_fd()
                try:
                    init_ms, init_error = await env.start(cfg, self.state_dir / "code" / cfg.code_hex, self.region, fd,
                                                          self.init_timeout_s)
                finally:
                    os.close(fd)
                pool.stats.cold_starts += 1
                pool.stats.init_ms += init_ms
                report["init_ms"] = init_ms
                if init_error is not None:
                    pool.stats.init_errors += 1
                    return {"ok": False}, init_error, report
            env.invocations += 1
            header = {"id": request_id, "arn": cfg.arn(self.region), "deadline_ms": int(time.time() * 1000) + cfg.timeout * 1000}
            t0 = time.perf_counter()
            try:
                result, body = await asyncio.wait_for(env.invoke(header, payload), cfg.timeout)
                reusable = True
            except asyncio.TimeoutError:
                pool.stats.timeouts += 1
                msg = f"{_now_iso()} {request_id} Task timed out after {cfg.timeout:.2f} seconds"
                result, body = {"ok": False}, json.dumps({"errorMessage": msg, "errorType": "Sandbox.Timedout"}).encode()
            except WorkerGone as e:
                result = {"ok": False}
                body = json.dumps({"errorMessage": f"RequestId: {request_id} Error: Runtime exited with error: {e}",
                                   "errorType": "Runtime.ExitError"}).encode()
            report["duration_ms"] = (time.perf_counter() - t0) * 1000
            report["max_rss_mb"] = result.get("max_rss_mb", 0)
            return result, body, report
        finally:
            pool.release(env, reusable)

    def _account(self, pool: FunctionPool, result: dict, body: bytes, report: dict, request_id: str):
        duration = report.get("duration_ms", 0.0)
        # Billed: duration rounded up to 1 ms; the INIT phase is billed too (on-demand, since August 2025).
        billed = math.ceil(duration + report["init_ms"]) if report["cold"] else math.ceil(duration)
        report["billed_ms"] = max(1, billed)
        st = pool.stats
        st.invocations += 1
        st.billed_ms += report["billed_ms"]
        st.duration_ms += duration
        if not result.get("ok"):
            st.errors += 1
        report["log"] = result.get("log", "")

    def report_tail(self, pool: FunctionPool, report: dict, request_id: str) -> str:
        init = f"\tInit Duration: {report['init_ms']:.2f} ms" if report["cold"] else ""
        text = (f"START RequestId: {request_id} Version: $LATEST\n{report.get('log', '')}END RequestId: {request_id}\n"
                f"REPORT RequestId: {request_id}\tDuration: {report.get('duration_ms', 0.0):.2f} ms\t"
                f"Billed Duration: {report['billed_ms']} ms\tMemory Size: {pool.cfg.memory} MB\t"
                f"Max Memory Used: {report.get('max_rss_mb', 0)} MB{init}\t\n")
        return base64.b64encode(text.encode()[-4096:]).decode()

    async def invoke(self, ref: str, qualifier: str | None, payload: bytes, invocation_type: str, log_type: str,
                     request_id: str) -> Outcome:
        pool = self.resolve(ref, qualifier)
        if invocation_type not in ("RequestResponse", "Event", "DryRun"):
            raise invalid(f"Unsupported InvocationType {invocation_type!r}")
        limit = MAX_ASYNC_PAYLOAD if invocation_type == "Event" else MAX_SYNC_PAYLOAD
        if len(payload) > limit:
            raise LambdaError(413, "RequestEntityTooLargeException",
                              f"Request must be smaller than {limit} bytes for the InvokeFunction operation")
        if payload.strip():
            try:
                json.loads(payload)
            except ValueError:
                raise LambdaError(400, "InvalidRequestContentException", "Could not parse request body into json") from None
        base = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": "$LATEST"}
        if invocation_type == "DryRun":
            return Outcome(204, b"", base)
        if invocation_type == "Event":
            pool.stats.async_invocations += 1
            task = asyncio.ensure_future(self._run_event(pool, payload, request_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return Outcome(202, b"", {"x-amzn-RequestId": request_id})
        try:
            result, body, report = await self._run(pool, payload, request_id)
        except Throttled:
            reason = ("ReservedFunctionConcurrentInvocationLimitExceeded" if pool.cfg.reserved is not None
                      else "ConcurrentInvocationLimitExceeded")
            raise LambdaError(429, "TooManyRequestsException", "Rate Exceeded.", Reason=reason) from None
        if result.get("ok") and len(body) > MAX_SYNC_PAYLOAD:
            result = {"ok": False, "log": result.get("log", "")}
            body = json.dumps({"errorMessage": f"Response payload size ({len(body)} bytes) exceeded maximum allowed payload "
                                               f"size ({MAX_SYNC_PAYLOAD} bytes).", "errorType": "Function.ResponseSizeTooLarge"}).encode()
        self._account(pool, result, body, report, request_id)
        headers = {**base, "Content-Type": "application/json", "X-Rollart-Billed-Ms": str(report["billed_ms"]),
                   "X-Rollart-Cold-Start": "true" if report["cold"] else "false"}
        if report["cold"]:
            headers["X-Rollart-Init-Ms"] = f"{report['init_ms']:.2f}"
        if not result.get("ok"):
            headers["X-Amz-Function-Error"] = "Unhandled"
        if log_type == "Tail":
            headers["X-Amz-Log-Result"] = self.report_tail(pool, report, request_id)
        return Outcome(200, body, headers)

    async def _run_event(self, pool: FunctionPool, payload: bytes, request_id: str):
        """Asynchronous invocation: queued while throttled, dropped after max_event_age_s (no retries on errors)."""
        deadline, delay = time.monotonic() + self.max_event_age_s, 0.02
        while True:
            if self.pools.get(pool.cfg.name) is not pool:
                return  # deleted meanwhile
            try:
                result, body, report = await self._run(pool, payload, request_id)
            except Throttled:
                if time.monotonic() + delay > deadline:
                    pool.stats.async_dropped += 1
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self._account(pool, result, body, report, request_id)
            return

    # --- lifecycle -----------------------------------------------------------------------------

    async def reaper(self):
        interval = max(0.05, min(1.0, self.keep_warm_s / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for pool in list(self.pools.values()):
                pool.reap(now)

    async def close(self):
        for task in list(self._tasks):
            task.cancel()
        envs = [e for pool in self.pools.values() for e in pool.envs]
        for pool in self.pools.values():
            pool.close()
        waits = [e.reaped for e in envs if e.reaped is not None]
        if waits:
            await asyncio.wait(waits, timeout=5)

    def stats(self) -> dict:
        return {"uptime_s": round(time.monotonic() - self.started, 3), "requests": self.requests,
                "auth_failures": self.auth_failures, "default_concurrency": self.default_concurrency,
                "keep_warm_s": self.keep_warm_s, "functions": {n: p.snapshot() for n, p in self.pools.items()}}


# --- auth ----------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname, "" or "0.0.0.0": reachable from elsewhere


def verify_sigv4(method: str, raw_path: str, headers, body: bytes, secret: str) -> str | None:
    """None when the request is SigV4-signed with ``secret``; otherwise why not."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    m = SIGV4_RE.match(headers.get("Authorization", ""))
    if not m:
        return "missing or malformed AWS4-HMAC-SHA256 Authorization header"
    akid, date, region, service, signed, signature = m.groups()
    amz_date = headers.get("X-Amz-Date", "")
    try:
        when = dt.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return "missing or malformed X-Amz-Date"
    if abs((dt.datetime.now(dt.timezone.utc) - when).total_seconds()) > SIGV4_SKEW_S or amz_date[:8] != date:
        return "signature expired or dated outside the allowed clock skew"
    names = signed.split(";")
    if "host" not in names:
        return "the Host header must be signed"
    signed_headers = {}
    for name in names:
        values = headers.getall(name, None) if hasattr(headers, "getall") else [headers.get(name)]
        if not values or values[0] is None:
            return f"signed header {name!r} is missing"
        signed_headers[name] = ",".join(values)
    req = AWSRequest(method=method, url=f"http://{signed_headers['host']}{raw_path}", headers=signed_headers, data=body)
    req.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(akid, secret), service, region)
    expected = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    return None if hmac.compare_digest(expected, signature) else "signature does not match"


# --- HTTP ----------------------------------------------------------------------------------------

def make_app(service: LocalLambda, token: str | None = None) -> web.Application:
    async def read_body(request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > MAX_REQUEST:
            raise LambdaError(413, "RequestEntityTooLargeException", f"Request must be smaller than {MAX_REQUEST} bytes")
        chunks, size = [], 0
        async for chunk in request.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > MAX_REQUEST:
                raise LambdaError(413, "RequestEntityTooLargeException", f"Request must be smaller than {MAX_REQUEST} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    @web.middleware
    async def middleware(request: web.Request, handler):
        request_id = str(uuid.uuid4())
        request[REQUEST_ID] = request_id
        service.requests += 1
        try:
            request[BODY] = await read_body(request)
            if token and request.path != "/_local/health":
                authz = request.headers.get("Authorization", "")
                if authz.startswith("Bearer ") and request.path.startswith("/_local/"):
                    ok = hmac.compare_digest(authz[7:].strip().encode(), token.encode())
                    why = None if ok else "bad bearer token"
                else:
                    why = verify_sigv4(request.method, request.raw_path, request.headers, request[BODY], token)
                if why is not None:
                    service.auth_failures += 1
                    code = "MissingAuthenticationTokenException" if not authz else "InvalidSignatureException"
                    raise LambdaError(403, code, f"Request not authorized: {why}")
            return await handler(request)
        except LambdaError as e:
            return e.response(request_id)
        except web.HTTPException as e:
            if e.status == 404:
                return LambdaError(404, "UnknownOperationException", f"Unknown operation {request.method} {request.path}").response(request_id)
            if e.status == 405:
                return LambdaError(405, "UnknownOperationException", f"Unknown operation {request.method} {request.path}").response(request_id)
            raise
        except Exception as e:  # a fault of the endpoint: a retryable 5xx, never something that looks like a reward
            log.exception("request %s %s failed", request.method, request.path)
            return LambdaError(500, "ServiceException", f"{type(e).__name__}: {e}").response(request_id)

    def json_body(request) -> dict:
        try:
            body = json.loads(request[BODY] or b"{}")
        except ValueError:
            raise LambdaError(400, "InvalidRequestContentException", "Could not parse request body into json") from None
        if not isinstance(body, dict):
            raise LambdaError(400, "InvalidRequestContentException", "The request body must be a JSON object")
        return body

    def reply(request, data: dict | None, status: int = 200) -> web.Response:
        headers = {"x-amzn-RequestId": request[REQUEST_ID]}
        if data is None:
            return web.Response(status=status, headers=headers)
        return web.json_response(data, status=status, headers=headers)

    async def invoke(request: web.Request):
        out = await service.invoke(request.match_info["name"], request.query.get("Qualifier"), request[BODY],
                                   request.headers.get("X-Amz-Invocation-Type", "RequestResponse"),
                                   request.headers.get("X-Amz-Log-Type", "None"), request[REQUEST_ID])
        return web.Response(status=out.status, body=out.body, headers=out.headers)

    async def create(request):
        return reply(request, await service.create_function(json_body(request)), 201)

    async def update_code(request):
        return reply(request, await service.update_code(request.match_info["name"], json_body(request)))

    async def update_config(request):
        return reply(request, service.update_configuration(request.match_info["name"], json_body(request)))

    async def get_function(request):
        return reply(request, service.get_function(request.match_info["name"], request.query.get("Qualifier")))

    async def get_config(request):
        return reply(request, service.get_function(request.match_info["name"], request.query.get("Qualifier"))["Configuration"])

    async def list_functions(request):
        return reply(request, {"Functions": [p.cfg.to_api(service.region) for p in service.pools.values()]})

    async def delete(request):
        service.delete_function(request.match_info["name"], request.query.get("Qualifier"))
        return reply(request, None, 204)

    async def put_concurrency(request):
        return reply(request, service.put_concurrency(request.match_info["name"], json_body(request)))

    async def get_concurrency(request):
        pool = service.resolve(request.match_info["name"])
        return reply(request, {} if pool.cfg.reserved is None else {"ReservedConcurrentExecutions": pool.cfg.reserved})

    async def delete_concurrency(request):
        service.delete_concurrency(request.match_info["name"])
        return reply(request, None, 204)

    async def health(request):
        sock = request.transport.get_extra_info("socket") if request.transport else None
        nodelay = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)) if sock is not None and sock.family != socket.AF_UNIX else None
        return reply(request, {"status": "ok", "functions": len(service.pools), "tcp_nodelay": nodelay})

    async def stats(request):
        return reply(request, service.stats())

    app = web.Application(client_max_size=MAX_REQUEST, middlewares=[middleware])
    fn = "/2015-03-31/functions/{name}"
    app.router.add_post(fn + "/invocations", invoke)
    app.router.add_post("/2015-03-31/functions", create)
    app.router.add_post("/2015-03-31/functions/", create)
    app.router.add_get("/2015-03-31/functions/", list_functions)
    app.router.add_get("/2015-03-31/functions", list_functions)
    app.router.add_get(fn, get_function)
    app.router.add_delete(fn, delete)
    app.router.add_put(fn + "/code", update_code)
    app.router.add_get(fn + "/configuration", get_config)
    app.router.add_put(fn + "/configuration", update_config)
    app.router.add_put("/2017-10-31/functions/{name}/concurrency", put_concurrency)
    app.router.add_delete("/2017-10-31/functions/{name}/concurrency", delete_concurrency)
    app.router.add_get("/2019-09-30/functions/{name}/concurrency", get_concurrency)
    app.router.add_get("/_local/health", health)
    app.router.add_get("/_local/stats", stats)

    async def lifecycle(app):
        reaper = asyncio.ensure_future(service.reaper())
        yield
        reaper.cancel()
        await service.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def _check_token(host: str, token: str | None) -> str | None:
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN_LEN:
        raise ValueError(f"the auth token must be at least {MIN_TOKEN_LEN} characters")
    if token is None and not is_loopback(host):
        raise ValueError(f"refusing to bind the Lambda endpoint to non-loopback address {host!r} without an auth token "
                         f"(pass token=... or set {TOKEN_ENV}; clients sign with it as the AWS secret access key)")
    return token


def default_state_dir() -> Path:
    return Path(os.environ.get("ROLLART_CACHE", Path.home() / ".cache" / "rollart-dask")) / "lambda"


def _url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _start(host: str, port: int, service: LocalLambda, token: str | None) -> tuple[web.AppRunner, str]:
    family, _, _, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    sock.bind(addr)
    sock.listen(1024)
    sock.setblocking(False)
    runner = web.AppRunner(make_app(service, token), access_log=None, handle_signals=False, shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=1024).start()
    return runner, _url(host, sock.getsockname()[1])


def serve(host: str = "127.0.0.1", port: int = 9001, state_dir: str | Path | None = None, keep_warm_s: float = 300.0,
          default_concurrency: int | None = None, token: str | None = None, region: str = "us-east-1",
          init_timeout_s: float = 10.0, on_ready=None, exit_with_parent: bool = False) -> None:
    """Run the endpoint until SIGINT/SIGTERM (blocking). ``token`` defaults to $ROLLART_LAMBDA_TOKEN;
    a non-loopback ``host`` without one raises ValueError. ``on_ready(url)`` is called once listening.
    ``exit_with_parent``: also stop when the parent process goes away (an embedded endpoint)."""
    token = _check_token(host, token)
    service = LocalLambda(Path(state_dir) if state_dir else default_state_dir(), region, keep_warm_s, default_concurrency,
                          init_timeout_s)

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        runner, url = await _start(host, port, service, token)
        watcher = None
        if exit_with_parent:
            parent = os.getppid()

            async def watch():
                while os.getppid() == parent:
                    await asyncio.sleep(1.0)
                stop.set()

            watcher = asyncio.ensure_future(watch())
        try:
            if on_ready is not None:
                on_ready(url)
            else:
                print(f"rollart lambda endpoint: {url} (state {service.state_dir})", file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            if watcher is not None:
                watcher.cancel()
            await service.close()  # in-flight invocations end now (their processes are killed)
            await runner.cleanup()

    asyncio.run(main())


class LocalEndpoint:
    """A running endpoint: ``url``, ``stop()``, ``stats()``; a context manager."""

    def __init__(self, url: str, state_dir: Path, token: str | None, stop):
        self.url, self.state_dir, self.token, self._stop = url, state_dir, token, stop

    def stats(self) -> dict:
        import urllib.request

        req = urllib.request.Request(self.url + "/_local/stats")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY
        with opener.open(req, timeout=10) as r:
            return json.loads(r.read())

    def stop(self):
        if self._stop is not None:
            self._stop()
            self._stop = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_local_endpoint(host: str = "127.0.0.1", port: int = 0, state_dir: str | Path | None = None,
                         keep_warm_s: float = 300.0, default_concurrency: int | None = None, token: str | None = None,
                         region: str = "us-east-1", init_timeout_s: float = 10.0, mode: str = "thread",
                         ready_timeout_s: float = 30.0) -> LocalEndpoint:
    """Start the endpoint in the background and return once it accepts requests; port 0 picks a free port.

    mode="thread": its own event loop in a daemon thread of this process (tests, light use).
    mode="process": a child process (``python -m rollart_dask.serverless.server``), off this process's GIL.
    state_dir=None: a fresh temporary directory.
    """
    token = _check_token(host, token)
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="rollart-lambda-"))
    if mode == "process":
        return _start_process(host, port, state, keep_warm_s, default_concurrency, token, region, init_timeout_s, ready_timeout_s)
    if mode != "thread":
        raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
    service = LocalLambda(state, region, keep_warm_s, default_concurrency, init_timeout_s)
    ready = threading.Event()
    box: dict = {}

    def run():
        async def main():
            box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
            try:
                runner, box["url"] = await _start(host, port, service, token)
            except BaseException as e:
                box["error"] = e
                ready.set()
                return
            ready.set()
            try:
                await box["stop"].wait()
            finally:
                await service.close()
                await runner.cleanup()

        asyncio.run(main())

    thread = threading.Thread(target=run, name="rollart-lambda-endpoint", daemon=True)
    thread.start()
    if not ready.wait(ready_timeout_s):
        raise TimeoutError(f"the local Lambda endpoint did not start within {ready_timeout_s}s")
    if "error" in box:
        raise box["error"]

    def stop():
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(30)

    return LocalEndpoint(box["url"], state, token, stop)


def _start_process(host, port, state, keep_warm_s, default_concurrency, token, region, init_timeout_s, ready_timeout_s):
    cmd = [sys.executable, "-m", "rollart_dask.serverless.server", "--host", host, "--port", str(port), "--state-dir", str(state),
           "--keep-warm-s", str(keep_warm_s), "--region", region, "--init-timeout-s", str(init_timeout_s), "--print-url", "--exit-with-parent"]
    if default_concurrency:
        cmd += ["--default-concurrency", str(default_concurrency)]
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token  # not on the command line, where `ps` would show it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    box: dict = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(ready_timeout_s)
    url = (box.get("line") or "").strip()
    if not url.startswith("http"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the local Lambda endpoint process did not start (exit {proc.poll()})")

    def stop():
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return LocalEndpoint(url, state, token, stop)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rollart_dask.serverless.server",
                                description="Local AWS-Lambda-compatible endpoint for reward functions")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--keep-warm-s", type=float, default=300.0)
    p.add_argument("--default-concurrency", type=int, default=None)
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--init-timeout-s", type=float, default=10.0)
    p.add_argument("--print-url", action="store_true", help="print the URL on stdout once listening")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")
    a = p.parse_args(argv)
    on_ready = (lambda url: print(url, flush=True)) if a.print_url else None
    try:
        serve(a.host, a.port, a.state_dir, a.keep_warm_s, a.default_concurrency, None, a.region, a.init_timeout_s, on_ready,
              a.exit_with_parent)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
