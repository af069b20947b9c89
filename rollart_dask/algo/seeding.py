"""Seeds for replayable sampling (rollout.deterministic): each generated token is drawn from a generator of its own,
seeded by what identifies it in the run — the run's seed, the group's launch ordinal, the member's index, the turn and
the token's place in the response — never by arrival order or by whatever else an engine batched beside it. Pure."""

from __future__ import annotations

import hashlib

EVAL = 1 << 40  # a part that sets held-out trajectories' seeds apart from training groups' ordinals


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integers; distinct tuples give independent seeds (blake2b, not a sum that collides)."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
