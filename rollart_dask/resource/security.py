"""Who can reach the cluster. A Dask scheduler runs whatever pickled function it is sent, so the embedded
cluster listens on loopback only unless ``cluster.listen`` names another interface; exposed, every comm is
TLS with client certificates required (the user's files, or a CA and certificate made for the run, held
in memory). The dashboard is an HTTP server of its own, bound where ``cluster.dashboard_address`` says."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import dask.config
from distributed.security import Security

from rollart_dask.config import ClusterConfig, FlowError, SecurityConfig

ROLES = ("client", "scheduler", "worker")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname resolves wherever it resolves: treat it as reachable


def host_of(address: str) -> str:
    """The host of ``host:port`` / ``[v6]:port`` / ``:port`` ('' = every interface) / ``scheme://host:port``."""
    address = address.split("://", 1)[-1]
    if address.startswith("["):
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def write_certificates(directory) -> dict[str, str]:
    """ca.pem, cert.pem, key.pem in ``directory`` (the key readable by its owner only): one self-signed certificate
    for every role, as Dask's ``Security.temporary`` makes in memory, for the recipes of deploy/ and ``cluster.security``."""
    pem = Security.temporary()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for field, name, text in (
        ("ca_file", "ca.pem", pem.tls_ca_file),
        ("cert", "cert.pem", pem.tls_scheduler_cert),
        ("key", "key.pem", pem.tls_scheduler_key),
    ):
        path = out / name
        path.touch(mode=0o600)  # private before the key is in it
        path.write_text(text)
        path.chmod(0o600 if name == "key.pem" else 0o644)
        paths[field] = str(path.resolve())
    return paths


def exposed(cfg: ClusterConfig) -> bool:
    return not is_loopback(cfg.listen)


def files_security(files: SecurityConfig) -> Security:
    """One certificate for every role (as Dask's ``Security.temporary``), client certificates required."""
    return Security(
        require_encryption=True,
        tls_ca_file=files.ca_file,
        **{f"tls_{role}_{part}": getattr(files, part) for role in ROLES for part in ("cert", "key")},
    )


def embedded_security(cfg: ClusterConfig) -> Security | None:
    """TLS for the embedded cluster: on when it is exposed (or files are given); None = plain TCP on loopback."""
    if cfg.security is not None:
        return files_security(cfg.security)
    return Security.temporary() if exposed(cfg) else None


def attach_security(cfg: ClusterConfig, given: Security | None = None) -> Security | None:
    """For ``cluster.scheduler``: ``given`` (an attaching client's), the flow's files, else Dask's own configuration."""
    if given is not None:
        return given
    if cfg.security is not None:
        return files_security(cfg.security)
    if cfg.scheduler.startswith("tls://") and not dask.config.get("distributed.comm.tls.ca-file", None):
        raise FlowError(
            f"cluster.scheduler {cfg.scheduler} is TLS: give cluster.security {{ca_file, cert, key}} "
            "(or Dask's own distributed.comm.tls configuration)"
        )
    return None


def scheduler_env(security: Security | None) -> dict[str, str]:
    """The scheduler process's TLS as Dask configuration in its environment (a file path or the PEM itself: Dask
    takes either). Only that process gets it; the workers receive their Security from their Nanny."""
    if security is None:
        return {}
    keys = {
        "tls_ca_file": "CA_FILE",
        "tls_scheduler_cert": "SCHEDULER__CERT",
        "tls_scheduler_key": "SCHEDULER__KEY",
        "tls_client_cert": "CLIENT__CERT",
        "tls_client_key": "CLIENT__KEY",
    }
    env = {f"DASK_DISTRIBUTED__COMM__TLS__{name}": getattr(security, attr) for attr, name in keys.items() if getattr(security, attr)}
    env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] = "True"
    return env


MOONCAKE_TRANSPORT = (
    "[bold yellow]weights.store=mooncake[/bold yellow]: Mooncake's transfer engine listens on every interface in the "
    "trainer's and engines' processes, unauthenticated (its TCP transport and handshake ports have no bind option; "
    "MC_TCP_BIND_ADDRESS only names the address it advertises): use weights.store=dask where others share the network"
)


def describe(cfg: ClusterConfig, address: str, dashboard_link: str) -> list[str]:
    """What a run says at start about who can reach it."""
    if cfg.scheduler:
        tls = address.startswith("tls://")
        return [
            f"cluster: {address} (attached{', TLS' if tls else ', plain TCP: anyone who reaches it can run code there'})",
            f"dashboard: {dashboard_link}",
        ]
    if exposed(cfg):
        certs = "your cluster.security files" if cfg.security else "certificates made for this run"
        lines = [f"cluster: {address} [bold yellow]exposed[/bold yellow] on {cfg.listen}, TLS with client certificates ({certs})"]
    else:
        lines = [f"cluster: {address} (loopback only; cluster.listen exposes it, with TLS)"]
    dash = host_of(cfg.dashboard_address)
    where = (
        "loopback only"
        if is_loopback(dash or "0.0.0.0")
        else f"[bold yellow]exposed[/bold yellow] on {dash or 'every interface'}, plain HTTP, no authentication"
    )
    lines.append(f"dashboard: {dashboard_link} ({where}; bound apart from the cluster by cluster.dashboard_address)")
    return lines
