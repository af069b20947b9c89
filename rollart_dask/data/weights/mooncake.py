"""Mooncake: the local master for the embedded default, and one store client per worker process.

The embedded default runs ``mooncake_master`` (the object-store master) and the wheel's HTTP
metadata server for the transfer engine, so it needs no etcd; both on 127.0.0.1 (the master's own
metadata server binds every interface whatever ``--http_metadata_server_host`` says, so it is off). Each process that
publishes or pulls (the trainer's, every engine's) sets up one client; it also lends
``segment_mb`` of its memory to the store, which is where published buckets live. The wheel
here is ``mooncake-transfer-engine-non-cuda`` over TCP; on GPU clusters the CUDA/RDMA wheel
with ``protocol: rdma`` moves the same buckets without changing this code.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

_clients: dict[tuple, object] = {}
_lock = threading.Lock()


class MooncakeError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str:
    """The ``mooncake_master`` of the Python environment running us (the wheel installs it next to python)."""
    exe = Path(sys.executable).parent / "mooncake_master"
    found = str(exe) if exe.exists() else shutil.which("mooncake_master")
    if not found:
        raise MooncakeError(
            "weights.store=mooncake needs mooncake_master: pip install 'rollart-dask[mooncake]' "
            "(mooncake-transfer-engine-non-cuda on CPU machines; Debian's libibverbs1 must be installed)"
        )
    return found


class LocalMaster:
    """``mooncake_master`` and the transfer engine's metadata server, subprocesses on 127.0.0.1 for the run's
    lifetime (embedded default only)."""

    def __init__(self, log_path: Path, lease_ms: int = 1000):
        self.rpc_port, self.http_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log_path = log_path
        self.lease_ms = lease_ms
        self.procs: list[subprocess.Popen] = []

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def _master_cmd(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=false",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ms}",
        ]

    def start(self, timeout_s: float = 20) -> "LocalMaster":
        master = self._master_cmd()
        metadata = [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host=127.0.0.1",
            f"--port={self.http_port}",
            "--log-level=WARNING",
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # their periodic metrics go to a file, never to an unread pipe
        self.procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL) for cmd in (master, metadata)]
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # ready once both the RPC and the metadata ports accept
            for proc, cmd in zip(self.procs, (master, metadata)):
                if proc.poll() is not None:
                    code = proc.returncode
                    self.stop()
                    raise MooncakeError(
                        f"{Path(cmd[0]).name if cmd is master else 'the mooncake metadata server'} exited with {code} "
                        f"at start; see {self.log_path}{missing_library(self.log_path)}"
                    )
            if all(_accepts(p) for p in (self.rpc_port, self.http_port)):
                return self
            time.sleep(0.1)
        self.stop()
        raise MooncakeError(
            f"mooncake_master did not listen on ports {self.rpc_port}/{self.http_port} within {timeout_s:.0f} s; see {self.log_path}"
        )

    def kill_master(self) -> None:
        """The master process killed (the chaos suite): every object it knew of is gone; the metadata server stays."""
        self.procs[0].kill()
        self.procs[0].wait()

    def restart_master(self, timeout_s: float = 20) -> None:
        """A fresh master on the same port (the chaos suite): the clients' heartbeats find it and mount their segments again."""
        with open(self.log_path, "ab") as log:
            self.procs[0] = subprocess.Popen(self._master_cmd(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not _accepts(self.rpc_port):
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise MooncakeError(f"mooncake_master did not start again on port {self.rpc_port}; see {self.log_path}")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def client(spec: dict, local_hostname: str):
    """This process's store client for ``spec`` (master, metadata_server, protocol, device, segment_mb, buffer_mb)."""
    key = (spec["master"], spec["metadata_server"], spec["protocol"], local_hostname)
    with _lock:
        if key not in _clients:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as e:
                raise MooncakeError(
                    f"weights.store=mooncake: cannot import mooncake.store ({e}); pip install 'rollart-dask[mooncake]' "
                    "and apt-get install libibverbs1"
                ) from e
            if spec.get("log_dir"):  # the transfer engine's own log files (its errors still reach stderr)
                os.environ.setdefault("MC_LOG_DIR", spec["log_dir"])
                Path(spec["log_dir"]).mkdir(parents=True, exist_ok=True)
            store = MooncakeDistributedStore()
            rc = store.setup(
                local_hostname,
                spec["metadata_server"],
                spec["segment_mb"] << 20,
                spec["buffer_mb"] << 20,
                spec["protocol"],
                spec.get("device") or "",
                spec["master"],
            )
            if rc != 0:
                raise MooncakeError(
                    f"mooncake store setup failed (code {rc}) for master {spec['master']}, metadata {spec['metadata_server']}, "
                    f"host {local_hostname}, protocol {spec['protocol']}"
                )
            _clients[key] = store
        return _clients[key]


def local_hostname(address: str | None) -> str:
    """The host this worker is reached at (its Dask address' host), which the transfer engine advertises."""
    if address and "://" in address:
        host = address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        if host not in ("", "0.0.0.0"):
            return host
    return os.environ.get("ROLLART_MOONCAKE_HOST", "127.0.0.1")


def close_clients(dask_worker=None) -> int:
    """Unmount this process's segments while the master still runs (called on every worker at the run's end)."""
    with _lock:
        n = len(_clients)
        for store in _clients.values():
            store.close()
        _clients.clear()
    return n


LIBRARIES = {"libibverbs.so.1": "libibverbs1"}  # what the Mooncake wheel loads even over TCP → its Debian package


def missing_library(log: Path) -> str:
    """What to do when the log says a shared library was not found: the package and the command, or ''."""
    text = log.read_text(errors="replace") if log.exists() else ""
    for lib, pkg in LIBRARIES.items():
        if lib in text and "cannot open shared object file" in text:
            return (
                f". {lib} is missing: install Debian's {pkg} (`sudo apt-get install {pkg}`; `make install` does it where it can), "
                f"or use weights.store=dask"
            )
    return ""
