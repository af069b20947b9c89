"""The local Lambda service: the function store (configs and code on disk) and invocation over the pools.

The HTTP layer (``routes``) is a thin shell around ``LocalLambda``. A handler that raises, exits
or overruns its Timeout yields ``X-Amz-Function-Error: Unhandled``; asynchronous (Event)
invocations queue while throttled.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from rollart_dask.serve.lambda_local.api import (
    ACCOUNT,
    ARN_RE,
    MAX_ASYNC_PAYLOAD,
    MAX_SYNC_PAYLOAD,
    MAX_ZIP,
    NAME_RE,
    FunctionConfig,
    LambdaError,
    Outcome,
    _now_iso,
    config_fields,
    invalid,
    not_found,
    unzip_code,
)
from rollart_dask.serve.lambda_local.faults import EndpointFaults
from rollart_dask.serve.lambda_local.pool import Environment, FunctionPool, Throttled, WorkerGone


class LocalLambda:
    """The functions, their code and their pools; the HTTP layer is a thin shell around it."""

    def __init__(
        self,
        state_dir: Path,
        region: str = "us-east-1",
        keep_warm_s: float = 300.0,
        default_concurrency: int | None = None,
        init_timeout_s: float = 10.0,
        max_event_age_s: float = 60.0,
        faults: dict | None = None,
    ):
        self.state_dir = Path(state_dir).resolve()  # file URIs in GetFunction need an absolute path
        self.faults = EndpointFaults(faults)  # EMULATED 429 / 500 / late answers (the chaos suite), off by default
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
                unzip_code(data, tmp)
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

    def _save(self, cfg: FunctionConfig):
        path = self.state_dir / "functions" / f"{cfg.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(cfg)))
        tmp.replace(path)

    # --- management ----------------------------------------------------------------------------

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
        fields = config_fields(body, None)
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
        for k, v in config_fields(body, pool.cfg).items():
            setattr(pool.cfg, k, v)
        pool.cfg.last_modified, pool.cfg.revision = _now_iso(), str(uuid.uuid4())
        self._save(pool.cfg)
        pool.reap(time.monotonic())
        return pool.cfg.to_api(self.region)

    def get_function(self, ref: str, qualifier: str | None) -> dict:
        pool = self.resolve(ref, qualifier)
        out = {
            "Configuration": pool.cfg.to_api(self.region),
            "Code": {"RepositoryType": "S3", "Location": (self.state_dir / "code" / f"{pool.cfg.code_hex}.zip").as_uri()},
            "Tags": {},
        }
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
                    init_ms, init_error = await env.start(cfg, self.state_dir / "code" / cfg.code_hex, self.region, fd, self.init_timeout_s)
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
                body = json.dumps(
                    {"errorMessage": f"RequestId: {request_id} Error: Runtime exited with error: {e}", "errorType": "Runtime.ExitError"}
                ).encode()
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
        text = (
            f"START RequestId: {request_id} Version: $LATEST\n{report.get('log', '')}END RequestId: {request_id}\n"
            f"REPORT RequestId: {request_id}\tDuration: {report.get('duration_ms', 0.0):.2f} ms\t"
            f"Billed Duration: {report['billed_ms']} ms\tMemory Size: {pool.cfg.memory} MB\t"
            f"Max Memory Used: {report.get('max_rss_mb', 0)} MB{init}\t\n"
        )
        return base64.b64encode(text.encode()[-4096:]).decode()

    async def invoke(
        self, ref: str, qualifier: str | None, payload: bytes, invocation_type: str, log_type: str, request_id: str
    ) -> Outcome:
        pool = self.resolve(ref, qualifier)
        if invocation_type not in ("RequestResponse", "Event", "DryRun"):
            raise invalid(f"Unsupported InvocationType {invocation_type!r}")
        limit = MAX_ASYNC_PAYLOAD if invocation_type == "Event" else MAX_SYNC_PAYLOAD
        if len(payload) > limit:
            raise LambdaError(
                413, "RequestEntityTooLargeException", f"Request must be smaller than {limit} bytes for the InvokeFunction operation"
            )
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
        await self.faults.before_invoke()
        try:
            result, body, report = await self._run(pool, payload, request_id)
        except Throttled:
            reason = (
                "ReservedFunctionConcurrentInvocationLimitExceeded"
                if pool.cfg.reserved is not None
                else "ConcurrentInvocationLimitExceeded"
            )
            raise LambdaError(429, "TooManyRequestsException", "Rate Exceeded.", Reason=reason) from None
        if result.get("ok") and len(body) > MAX_SYNC_PAYLOAD:
            result = {"ok": False, "log": result.get("log", "")}
            body = json.dumps(
                {
                    "errorMessage": f"Response payload size ({len(body)} bytes) exceeded maximum allowed payload "
                    f"size ({MAX_SYNC_PAYLOAD} bytes).",
                    "errorType": "Function.ResponseSizeTooLarge",
                }
            ).encode()
        self._account(pool, result, body, report, request_id)
        headers = {
            **base,
            "Content-Type": "application/json",
            "X-Rollart-Billed-Ms": str(report["billed_ms"]),
            "X-Rollart-Cold-Start": "true" if report["cold"] else "false",
        }
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
        return {
            "uptime_s": round(time.monotonic() - self.started, 3),
            "requests": self.requests,
            "auth_failures": self.auth_failures,
            "default_concurrency": self.default_concurrency,
            "keep_warm_s": self.keep_warm_s,
            "functions": {n: p.snapshot() for n, p in self.pools.items()},
            **({"emulated_faults": self.faults.injected} if self.faults.active else {}),
        }
