"""Safe by default: a run listens on loopback only (read off the OS's socket table); an exposed cluster is TLS
and refuses whoever comes without the run's certificates."""

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import time

import psutil
import pytest

RUN = [sys.executable, "-m", "rollart_dask.entry.cli", "run", "flows/quickstart.yaml"]


def listening(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process, address, port) of every socket in LISTEN state held by ``root`` or any process below it."""
    found = []
    for p in [root, *root.children(recursive=True)]:
        try:
            name = "mooncake metadata server" if "mooncake.http_metadata_server" in p.cmdline() else p.name()
            found += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # exited meanwhile
            pass
    return found


def run_and_watch(out, *sets: str) -> tuple[dict, str]:
    """Run the quickstart (3 steps, tiny) through the CLI, sampling its process tree's socket table until it ends:
    {(address, port): process name}, and its output."""
    args = [
        *RUN,
        "--out",
        str(out),
        "--set",
        "trainer.steps=3",
        "--set",
        "rollout.batch_groups=4",
        "--set",
        "eval.seeds=6",
        "--set",
        "eval.every=0",
        "--set",
        "observe.progress=false",
        *(a for s in sets for a in ("--set", s)),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[tuple[str, int], str] = {}
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            for name, ip, port in listening(root):
                seen[(ip, port)] = name
            time.sleep(0.3)
        log = proc.stdout.read()
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert sum(r["kind"] == "step" for r in rows) == 3, log[-2000:]
    return seen, log


def beyond_loopback(seen: dict) -> dict:
    return {addr: name for addr, name in seen.items() if not addr[0].startswith("127.") and addr[0] != "::1"}


def test_a_run_listens_on_loopback_only(tmp_path):
    """Every service a run starts by default — scheduler, dashboard, nannies, workers and their HTTP servers, and
    (serverless rewards) the local Lambda endpoint — sampled from the socket table while the run trains."""
    seen, log = run_and_watch(tmp_path / "run", "reward.mode=serverless")
    assert len(seen) >= 13, seen  # scheduler + dashboard, 5 nannies, 5 workers × (comm + HTTP), the endpoint
    assert not beyond_loopback(seen), f"listening beyond loopback: {beyond_loopback(seen)}"
    assert "loopback only" in log


@pytest.mark.needs("libibverbs")
def test_the_mooncake_master_and_metadata_server_listen_on_loopback_and_the_transfer_engine_is_named(tmp_path):
    """store=mooncake: the master and the metadata server the run starts stay on loopback; Mooncake's transfer engine
    cannot be bound (no option for it), so it is the only thing beyond loopback, in worker processes, and the run says so."""
    seen, log = run_and_watch(tmp_path / "run", "weights.store=mooncake")
    names = set(seen.values())
    assert {"mooncake_master", "mooncake metadata server"} <= names, seen
    outside = beyond_loopback(seen)
    assert outside and set(outside.values()) <= {"dask worker [tc"}, outside  # (the transfer engine's: trainer and engines)
    assert "listens on every interface" in " ".join(log.split())


def test_an_exposed_cluster_is_tls_and_refuses_a_client_without_its_certificates(run_async, tmp_path):
    """Exposed with the user's own files (cluster.security): TLS; a plain client, one with another CA's certificate
    and a TLS handshake without a certificate are all refused; `rollart cluster check --scheduler tls://…` with the
    files attaches, without them it is told what to give."""
    from distributed import Client
    from distributed.security import Security

    from rollart_dask.config import load_flow
    from rollart_dask.resource.cluster import connect

    pem = Security.temporary()
    files = {"ca_file": pem.tls_ca_file, "cert": pem.tls_scheduler_cert, "key": pem.tls_scheduler_key}
    for name, text in files.items():
        (tmp_path / f"{name}.pem").write_text(text)
    security = [f"cluster.security.{name}={tmp_path / f'{name}.pem'}" for name in files]
    cfg = load_flow("flows/quickstart.yaml", ["cluster.listen=0.0.0.0", *security]).cluster

    async def go():
        client, cluster = await connect(cfg)
        try:
            address = client.scheduler.address
            assert address.startswith("tls://"), address
            assert await client.submit(sum, [1, 2], resources={"CPU": 1}, pure=False) == 3  # the run's own certificates work
            host, port = address.removeprefix("tls://").rsplit(":", 1)
            refused = []
            for who, other in [("plain client", None), ("another CA's certificate", Security.temporary())]:
                try:
                    async with Client(
                        address.replace("tls://", "tcp://") if other is None else address, asynchronous=True, security=other, timeout=5
                    ):
                        refused.append((who, False))
                except (OSError, asyncio.TimeoutError, ssl.SSLError):
                    refused.append((who, True))
            refused.append(("TLS without a client certificate", await asyncio.to_thread(_handshake_refused, host, int(port))))
            check = [sys.executable, "-m", "rollart_dask.entry.cli", "cluster", "check", "flows/quickstart.yaml", "--scheduler", address]
            with_files = await asyncio.to_thread(
                subprocess.run, [*check, *(a for s in security for a in ("--set", s))], capture_output=True, text=True, timeout=120
            )
            without = await asyncio.to_thread(subprocess.run, check, capture_output=True, text=True, timeout=120)
            return address, refused, with_files, without
        finally:
            await client.close()
            await cluster.close()

    address, refused, with_files, without = run_async(go(), timeout=300)
    assert all(ok for _, ok in refused), refused
    assert with_files.returncode == 0 and f"flow quickstart can run on {address}" in with_files.stdout, (
        with_files.stdout + with_files.stderr
    )
    assert without.returncode != 0 and "give cluster.security" in without.stderr, without.stderr


def _handshake_refused(host: str, port: int) -> bool:
    """A TLS connection that trusts anything but presents no certificate: the server requires one."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            tls.sendall(b"\0" * 16)
            return tls.recv(1) == b""  # TLS 1.3: the refusal arrives as an alert at the first read
    except (ssl.SSLError, ConnectionError):
        return True
