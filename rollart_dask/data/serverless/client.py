"""Calling reward functions through the Lambda API: the same code for AWS Lambda and the local endpoint.

botocore's own retries are off; ``invoke_reward`` retries throttles (429), 5xx and connection
errors/timeouts with exponential backoff and jitter. A handler error raises RewardFunctionError
and a reward that cannot be obtained raises RewardUnavailable: never a made-up score.

Billing/cold-start facts: the local endpoint sends ``X-Rollart-Billed-Ms``, ``X-Rollart-Cold-Start``
and ``X-Rollart-Init-Ms``; AWS reports them only in the log, so with ``log_tail`` the REPORT line
of ``LogType=Tail`` is parsed (the local endpoint produces the same line).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from rollart_dask.data.reward_value import RewardValueError, reward_value

TOKEN_ENV = "ROLLART_LAMBDA_TOKEN"
LOCAL_ACCESS_KEY = "rollart"
THROTTLE_CODES = {"TooManyRequestsException", "ThrottlingException", "EC2ThrottledException"}
REPORT_FIELDS = {
    "duration_ms": r"\tDuration: ([\d.]+) ms",
    "billed_ms": r"Billed Duration: (\d+) ms",
    "init_ms": r"Init Duration: ([\d.]+) ms",
    "max_memory_mb": r"Max Memory Used: (\d+) MB",
}


class RewardError(RuntimeError):
    """Base of the errors a remote reward raises."""


class RewardFunctionError(RewardError):
    """The reward's handler failed (raised, timed out, exited or returned a non-reward)."""

    def __init__(self, function_name: str, error_type: str, message: str, stack_trace=None, stats=None):
        super().__init__(f"reward function {function_name!r} failed: {error_type}: {message}")
        self.function_name, self.error_type, self.error_message = function_name, error_type, message
        self.stack_trace, self.stats = list(stack_trace or []), stats


class RewardUnavailable(RewardError):
    """No reward could be obtained: retries exhausted, deadline passed, or a non-retryable API error."""

    def __init__(self, function_name: str, last_error: str, stats=None):
        attempts = stats.attempts if stats is not None else "?"
        super().__init__(f"reward function {function_name!r} unavailable after {attempts} attempt(s): {last_error}")
        self.function_name, self.last_error, self.stats = function_name, last_error, stats


@dataclass
class InvokeStats:
    function: str
    attempts: int = 0
    throttles: int = 0
    retries: int = 0
    latency_s: float = 0.0  # wall time of the whole call, retries and backoff included
    billed_ms: int | None = None
    cold_start: bool | None = None
    init_ms: float | None = None
    duration_ms: float | None = None
    errors: list = field(default_factory=list)  # the retried errors, in order


def is_aws_endpoint(endpoint_url: str | None) -> bool:
    if not endpoint_url:
        return True
    host = urlsplit(endpoint_url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def make_lambda_client(
    endpoint_url: str | None = None,
    region: str = "us-east-1",
    timeout_s: float = 120.0,
    token: str | None = None,
    max_connections: int = 64,
    connect_timeout_s: float = 5.0,
):
    """boto3's Lambda client with botocore retries off (``invoke_reward`` retries).

    endpoint_url=None: AWS with the standard credential chain. A local endpoint: requests are signed
    with ``token`` (default $ROLLART_LAMBDA_TOKEN) as the secret key, or dummy credentials without
    one; the credential chain is not consulted (it can stall on the instance metadata service).
    ``timeout_s`` is the per-request read timeout: keep it above the function's Timeout.
    """
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=region,
        retries={"total_max_attempts": 1, "mode": "standard"},
        read_timeout=timeout_s,
        connect_timeout=connect_timeout_s,
        max_pool_connections=max_connections,
        tcp_keepalive=True,
    )
    session = boto3.session.Session()  # sessions are not thread-safe: one per client
    kwargs = {}
    if not is_aws_endpoint(endpoint_url):
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        kwargs = {"aws_access_key_id": LOCAL_ACCESS_KEY, "aws_secret_access_key": token or "local"}
    return session.client("lambda", endpoint_url=endpoint_url, config=config, **kwargs)


def parse_report(log_result_b64: str | None) -> dict:
    """Fields of the REPORT line in a ``LogType=Tail`` log (duration_ms, billed_ms, init_ms, max_memory_mb)."""
    if not log_result_b64:
        return {}
    text = base64.b64decode(log_result_b64).decode("utf-8", "replace")
    report = next((line for line in reversed(text.splitlines()) if line.startswith("REPORT ")), "")
    out = {}
    for key, pattern in REPORT_FIELDS.items():
        m = re.search(pattern, "\t" + report)
        if m:
            out[key] = int(m.group(1)) if key in ("billed_ms", "max_memory_mb") else float(m.group(1))
    return out


def _encode(trajectory) -> bytes:
    try:
        return json.dumps(trajectory, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"the trajectory is not JSON-serialisable: {e}") from None


class _Retry(Exception):
    def __init__(self, error: str, throttle: bool = False):
        super().__init__(error)
        self.error, self.throttle = error, throttle


def _attempt(client, function_name: str, payload: bytes, qualifier, log_tail: bool, stats: InvokeStats) -> dict:
    """One Invoke: the reward dict, or _Retry, RewardFunctionError, RewardUnavailable."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    kwargs = {"FunctionName": function_name, "Payload": payload, "InvocationType": "RequestResponse"}
    if qualifier:
        kwargs["Qualifier"] = qualifier
    if log_tail:
        kwargs["LogType"] = "Tail"
    try:
        resp = client.invoke(**kwargs)
        body = resp["Payload"].read()
    except ClientError as e:
        err = e.response.get("Error", {})
        code, message = err.get("Code", "?"), err.get("Message", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status == 429 or code in THROTTLE_CODES:
            raise _Retry(f"{code}: {message}", throttle=True) from None
        if status >= 500:
            raise _Retry(f"{code} (HTTP {status}): {message}") from None
        raise RewardUnavailable(function_name, f"{code} (HTTP {status}): {message}", stats) from e
    except (BotoConnectionError, HTTPClientError) as e:  # connect/read timeouts, refused or dropped connections
        raise _Retry(f"{type(e).__name__}: {e}") from None
    headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    report = parse_report(resp.get("LogResult"))
    if "x-rollart-billed-ms" in headers:
        stats.billed_ms = int(headers["x-rollart-billed-ms"])
        stats.cold_start = headers.get("x-rollart-cold-start") == "true"
        stats.init_ms = float(headers["x-rollart-init-ms"]) if "x-rollart-init-ms" in headers else None
    elif report:
        stats.billed_ms = report.get("billed_ms")
        stats.cold_start = "init_ms" in report
        stats.init_ms = report.get("init_ms")
    stats.duration_ms = report.get("duration_ms", stats.duration_ms)
    if resp.get("FunctionError"):
        try:
            err = json.loads(body)
        except ValueError:
            err = {"errorMessage": body[:2000].decode("utf-8", "replace")}
        err = err if isinstance(err, dict) else {"errorMessage": str(err)}
        raise RewardFunctionError(
            function_name, err.get("errorType") or resp["FunctionError"], err.get("errorMessage", ""), err.get("stackTrace"), stats
        )
    try:
        out = json.loads(body)
    except ValueError:
        raise RewardFunctionError(function_name, "InvalidResult", f"the response is not JSON: {body[:200]!r}", None, stats) from None
    try:
        return reward_value(function_name, out)
    except RewardValueError as e:
        raise RewardFunctionError(function_name, "InvalidResult", str(e), None, stats) from None


def _delay(attempt: int, backoff: float, max_backoff: float) -> float:
    cap = min(max_backoff, backoff * (2**attempt))
    return cap / 2 + random.uniform(0, cap / 2)  # "equal jitter": spread out, never a zero wait


def _auto_tail(client, log_tail: bool | None) -> bool:
    return is_aws_endpoint(client.meta.endpoint_url) if log_tail is None else log_tail


def invoke_reward(
    client,
    function_name: str,
    trajectory: dict,
    retries: int = 8,
    backoff: float = 0.05,
    max_backoff: float = 2.0,
    timeout_s: float | None = None,
    qualifier: str | None = None,
    log_tail: bool | None = None,
) -> tuple[dict, InvokeStats]:
    """Score one trajectory with a deployed reward function: (reward dict with 'score', InvokeStats).

    Retries throttles, 5xx and connection errors/timeouts up to ``retries`` times with exponential
    backoff (``backoff`` doubling, capped at ``max_backoff``, jittered); ``timeout_s`` bounds the
    whole call including retries. ``log_tail`` (default: on for AWS) asks for the log tail to learn
    billed duration and cold starts there.
    """
    payload = _encode(trajectory)
    stats = InvokeStats(function=function_name)
    tail = _auto_tail(client, log_tail)
    t0 = time.monotonic()
    deadline = t0 + timeout_s if timeout_s else None
    last = "no attempt made"
    try:
        for attempt in range(retries + 1):
            stats.attempts += 1
            try:
                return _attempt(client, function_name, payload, qualifier, tail, stats), stats
            except _Retry as r:
                last = r.error
                stats.throttles += r.throttle
                stats.errors.append(r.error)
            if attempt == retries:
                break
            wait = _delay(attempt, backoff, max_backoff)
            if deadline is not None and time.monotonic() + wait >= deadline:
                last += f" (deadline of {timeout_s}s reached)"
                break
            stats.retries += 1
            time.sleep(wait)
        raise RewardUnavailable(function_name, last, stats)
    finally:
        stats.latency_s = time.monotonic() - t0


async def ainvoke_reward(client, function_name: str, trajectory: dict, **kwargs) -> tuple[dict, InvokeStats]:
    """``invoke_reward`` for event loops (in a thread: boto3 blocks; backoff sleeps there too)."""
    return await asyncio.to_thread(invoke_reward, client, function_name, trajectory, **kwargs)
