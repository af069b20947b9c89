"""weights.delta: a version published as its change from the previous one (pure: no cluster, no store).

Consecutive versions of one model pack into buckets of the same names, shapes and dtypes, so their bytes line up:
the delta of a bucket is the XOR of its bytes with the previous version's, its bytes grouped by their place in
each 4-byte word, compressed with zstd. Bytes that did not
change XOR to zeros, and an optimizer step that moves a float by a little leaves its sign and exponent alone, so the
delta compresses where the bucket itself does not. An engine rebuilds the bucket from the bytes it holds and checks
the full bucket's sha256 (buckets.verify): a delta applied to the wrong base is an error, never a mixed model.
"""

from __future__ import annotations

import numpy as np
import zstandard

LEVEL = 3  # zstd's default: most of the gain at a fraction of the higher levels' time
STRIDE = 4  # bytes per word regrouped before compression (a float32, or two bfloat16)


class DeltaUnavailable(RuntimeError):
    """An engine cannot apply a version's delta (it holds another base, or none): it pulls the full version."""


def _xor(a: bytes, b: bytes) -> np.ndarray:
    if len(a) != len(b):
        raise DeltaUnavailable(f"a delta needs buckets of one size ({len(a)} and {len(b)} bytes)")
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


def _planes(x: np.ndarray) -> np.ndarray:
    """Bytes regrouped by their place in each 4-byte word (all first bytes, then all second bytes, …): the sign and
    exponent bytes a small step leaves alone become long runs of zeros (the tail past the last word stays put)."""
    n = len(x) // STRIDE * STRIDE
    return np.concatenate([x[:n].reshape(-1, STRIDE).T.reshape(-1), x[n:]])


def _words(x: np.ndarray) -> np.ndarray:
    n = len(x) // STRIDE * STRIDE
    return np.concatenate([x[:n].reshape(STRIDE, -1).T.reshape(-1), x[n:]])


def encode(old: bytes, new: bytes) -> bytes:
    """The delta that turns ``old`` into ``new`` (same length)."""
    return zstandard.ZstdCompressor(level=LEVEL).compress(_planes(_xor(old, new)).tobytes())


def apply(old: bytes, delta: bytes) -> bytes:
    """``new`` from ``old`` and ``encode(old, new)``."""
    flipped = zstandard.ZstdDecompressor().decompress(delta, max_output_size=len(old) + 1)
    return _xor(old, _words(np.frombuffer(flipped, np.uint8)).tobytes()).tobytes()


def lines_up(old: list[bytes], new: list[bytes]) -> bool:
    """Whether two versions' buckets can be diffed byte for byte (the same count and sizes)."""
    return len(old) == len(new) and all(len(a) == len(b) for a, b in zip(old, new))
