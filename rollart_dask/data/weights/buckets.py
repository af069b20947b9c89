"""Bucketed weight publication, the part every store shares (pure: no cluster, no store).

A published version is a manifest plus byte buckets: parameters are grouped in order into
buckets of about ``bucket_bytes`` (a tensor larger than that gets a bucket of its own), each
bucket is packed as safetensors and carries its sha256. Pullers verify every bucket before
a byte of it reaches an engine, so a torn or mixed-up transfer is an error, never a model
silently built from two versions.
"""

from __future__ import annotations

import hashlib
import pickle
import time


class WeightsIntegrityError(RuntimeError):
    """A pulled bucket does not match its manifest (checksum, size or version)."""


class NonFiniteWeights(RuntimeError):
    """Weights holding NaN or inf: never published nor checkpointed (every engine would then sample from NaN)."""


def check_finite(state: dict, what: str) -> None:
    """NonFiniteWeights naming the first tensors with a NaN or inf value (the EMULATED trainer's markers pass)."""
    bad = [n for n, v in state.items() if hasattr(v, "is_floating_point") and v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise NonFiniteWeights(
            f"{what}: {len(bad)} of {len(state)} weight tensors hold NaN or inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); they are neither published nor checkpointed"
        )


def _nbytes(value) -> int:
    return int(value.numel() * value.element_size()) if hasattr(value, "element_size") else 8


def bucketize(state: dict, bucket_bytes: int) -> list[list[str]]:
    """Names grouped in state order into buckets of at most ``bucket_bytes`` (one oversized tensor alone)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, value in state.items():
        n = _nbytes(value)
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return [b for b in buckets if b]


def pack(tensors: dict) -> tuple[bytes, str]:
    """(bytes, format). Real weights are safetensors; the EMULATED trainer publishes a plain
    version marker (no torch in its process), which is pickled and labelled as such."""
    if tensors and all(hasattr(v, "element_size") for v in tensors.values()):
        from safetensors.torch import save

        return save({k: v.contiguous() for k, v in tensors.items()}), "safetensors"
    return pickle.dumps(tensors), "pickle"


def unpack(data: bytes, fmt: str) -> dict:
    if fmt == "safetensors":
        from safetensors.torch import load

        return load(data)
    return pickle.loads(data)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish_buckets(state: dict, version: int, bucket_bytes: int) -> tuple[dict, list[bytes]]:
    """(manifest, bucket bytes) of one version of ``state``; the manifest carries no data. Weights that are not all
    finite raise NonFiniteWeights: the check is part of this pass over every tensor."""
    t0 = time.perf_counter()
    check_finite(state, f"weights v{version}")
    blobs, entries = [], []
    for i, names in enumerate(bucketize(state, bucket_bytes)):
        data, fmt = pack({n: state[n] for n in names})
        blobs.append(data)
        entries.append({"index": i, "names": names, "nbytes": len(data), "sha256": sha256(data), "format": fmt})
    manifest = {"version": version, "buckets": entries, "bytes": sum(e["nbytes"] for e in entries), "pack_s": time.perf_counter() - t0}
    return manifest, blobs


def verify(manifest: dict, index: int, data: bytes) -> dict:
    """The tensors of bucket ``index`` once its bytes match the manifest."""
    entry = manifest["buckets"][index]
    if len(data) != entry["nbytes"] or sha256(data) != entry["sha256"]:
        raise WeightsIntegrityError(
            f"weights v{manifest['version']} bucket {index}: {len(data)} bytes with sha256 {sha256(data)[:12]}…, "
            f"manifest says {entry['nbytes']} bytes, {entry['sha256'][:12]}…"
        )
    tensors = unpack(data, entry["format"])
    if sorted(tensors) != sorted(entry["names"]):
        raise WeightsIntegrityError(
            f"weights v{manifest['version']} bucket {index}: holds {sorted(tensors)[:3]}…, manifest lists {entry['names'][:3]}…"
        )
    return tensors
