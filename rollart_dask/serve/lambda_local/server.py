"""Running the local Lambda endpoint: ``serve`` (blocking), ``start_local_endpoint`` (in the
background, a thread or a child process) and ``python -m rollart_dask.serve.lambda_local.server``.

The endpoint's parts: ``api`` (names, quotas, records, error shapes), ``pool`` (worker processes),
``service`` (function store and invocation), ``routes`` (HTTP) and ``auth`` (SigV4/token).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from aiohttp import web

from rollart_dask.data.serverless.client import TOKEN_ENV
from rollart_dask.serve.lambda_local.auth import check_token, is_loopback
from rollart_dask.serve.lambda_local.routes import make_app
from rollart_dask.serve.lambda_local.service import LocalLambda


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
    runner = web.AppRunner(
        make_app(service, token, loopback=is_loopback(host)), access_log=None, handle_signals=False, shutdown_timeout=2.0
    )
    await runner.setup()
    await web.SockSite(runner, sock, backlog=1024).start()
    return runner, _url(host, sock.getsockname()[1])


def serve(
    host: str = "127.0.0.1",
    port: int = 9001,
    state_dir: str | Path | None = None,
    keep_warm_s: float = 300.0,
    default_concurrency: int | None = None,
    token: str | None = None,
    region: str = "us-east-1",
    init_timeout_s: float = 10.0,
    on_ready=None,
    exit_with_parent: bool = False,
    faults: dict | None = None,
) -> None:
    """Run the endpoint until SIGINT/SIGTERM (blocking). ``token`` defaults to $ROLLART_LAMBDA_TOKEN, else a new one
    (printed); a non-loopback ``host`` without one raises ValueError. ``on_ready(url)`` is called once listening.
    ``exit_with_parent``: also stop when the parent process goes away (an embedded endpoint)."""
    token = check_token(host, token)
    service = LocalLambda(
        Path(state_dir) if state_dir else default_state_dir(), region, keep_warm_s, default_concurrency, init_timeout_s, faults=faults
    )

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
                print(
                    f"rollart lambda endpoint: {url} (state {service.state_dir})\ntoken (sign with it as the AWS secret access key, or "
                    f"set {TOKEN_ENV} for the run): {token}",
                    file=sys.stderr,
                    flush=True,
                )
            await stop.wait()
        finally:
            if watcher is not None:
                watcher.cancel()
            await service.close()  # in-flight invocations end now (their processes are killed)
            await runner.cleanup()

    asyncio.run(main())


class LocalEndpoint:
    """A running endpoint: ``url``, ``stop()``, ``stats()``; a context manager. ``process``: its child process
    (mode="process"), which can be killed and restarted."""

    def __init__(self, url: str, state_dir: Path, token: str | None, stop, process: "EndpointProcess | None" = None):
        self.url, self.state_dir, self.token, self._stop, self.process = url, state_dir, token, stop, process

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


def start_local_endpoint(
    host: str = "127.0.0.1",
    port: int = 0,
    state_dir: str | Path | None = None,
    keep_warm_s: float = 300.0,
    default_concurrency: int | None = None,
    token: str | None = None,
    region: str = "us-east-1",
    init_timeout_s: float = 10.0,
    mode: str = "thread",
    ready_timeout_s: float = 30.0,
    faults: dict | None = None,
) -> LocalEndpoint:
    """Start the endpoint in the background and return once it accepts requests; port 0 picks a free port.

    mode="thread": its own event loop in a daemon thread of this process (tests, light use).
    mode="process": a child process (``python -m rollart_dask.serve.lambda_local.server``), off this process's GIL.
    state_dir=None: a fresh temporary directory. faults: EMULATED 429/500/slow answers (LocalLambda).
    """
    token = check_token(host, token)
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="rollart-lambda-"))
    if mode == "process":
        return _start_process(host, port, state, keep_warm_s, default_concurrency, token, region, init_timeout_s, ready_timeout_s, faults)
    if mode != "thread":
        raise ValueError(f"mode must be 'thread' or 'process', got {mode!r}")
    service = LocalLambda(state, region, keep_warm_s, default_concurrency, init_timeout_s, faults=faults)
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


def _start_process(host, port, state, keep_warm_s, default_concurrency, token, region, init_timeout_s, ready_timeout_s, faults=None):
    cmd = [
        sys.executable,
        "-m",
        "rollart_dask.serve.lambda_local.server",
        "--host",
        host,
        "--state-dir",
        str(state),
        "--keep-warm-s",
        str(keep_warm_s),
        "--region",
        region,
        "--init-timeout-s",
        str(init_timeout_s),
        "--print-url",
        "--exit-with-parent",
    ]
    if default_concurrency:
        cmd += ["--default-concurrency", str(default_concurrency)]
    if faults:
        cmd += ["--faults", json.dumps(faults)]
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    if token:
        env[TOKEN_ENV] = token  # not on the command line, where `ps` would show it
    proc = EndpointProcess(cmd, env, ready_timeout_s)
    return LocalEndpoint(proc.start(port), state, token, proc.stop, process=proc)


class EndpointProcess:
    """The endpoint's child process; ``kill`` and ``restart`` (same port, same state directory: its functions
    are still deployed) are what a fault looks like to its callers."""

    def __init__(self, cmd: list[str], env: dict, ready_timeout_s: float):
        self.cmd, self.env, self.ready_timeout_s = cmd, env, ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self, port: int) -> str:
        proc = self.proc = subprocess.Popen([*self.cmd, "--port", str(port)], stdout=subprocess.PIPE, env=self.env, text=True)
        box: dict = {}
        reader = threading.Thread(target=lambda: box.setdefault("line", proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.ready_timeout_s)
        url = (box.get("line") or "").strip()
        if not url.startswith("http"):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the local Lambda endpoint process did not start (exit {proc.poll()})")
        self.port = int(url.rsplit(":", 1)[1])
        return url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> str:
        self.kill()
        return self.start(self.port)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m rollart_dask.serve.lambda_local.server", description="Local AWS-Lambda-compatible endpoint for reward functions"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--keep-warm-s", type=float, default=300.0)
    p.add_argument("--default-concurrency", type=int, default=None)
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--init-timeout-s", type=float, default=10.0)
    p.add_argument("--print-url", action="store_true", help="print the URL on stdout once listening")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")
    p.add_argument(
        "--faults",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='EMULATED faults: {"throttle": p, "error": p, "slow": p, "slow_s": s, "seed": n}',
    )
    a = p.parse_args(argv)
    on_ready = (lambda url: print(url, flush=True)) if a.print_url else None
    try:
        serve(
            a.host,
            a.port,
            a.state_dir,
            a.keep_warm_s,
            a.default_concurrency,
            None,
            a.region,
            a.init_timeout_s,
            on_ready,
            a.exit_with_parent,
            a.faults,
        )
    except ValueError as e:
        p.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
