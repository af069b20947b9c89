"""What runs inside the workers: the trainer publishes a version, engines stage it, the swap applies it.

Module state is per worker process: the trainer keeps the Dask store's buckets of a version
until the bucket tasks hand them to Dask, and an engine keeps the weights it pulled until
the next Update swaps them in. Pulls never touch the engine: it goes on generating with the
version it has.
"""

from __future__ import annotations

import time

from rollart_dask.data.plugins import ENGINE, TRAINER
from rollart_dask.data.tasks import _per_item, _reply, service
from rollart_dask.data.weights import delta
from rollart_dask.data.weights.buckets import publish_buckets, verify

_published: dict[int, list[bytes]] = {}  # trainer process, store=dask: version → bucket bytes not yet handed to Dask
_keys: dict[int, list[str]] = {}  # trainer process, store=mooncake: version → its keys (for garbage collection)
# trainer process, store=mooncake: version → its bucket bytes, the versions kept: put again should a restarted master have
# lost them (a master holds what it knows of only in memory). The price: keep_versions copies of the weights in host memory.
_blobs: dict[int, list[bytes]] = {}
PUT_RETRY_S = 30.0  # a master that does not answer (restarting) is waited for this long before a publish fails
_staged: dict[int, dict] = {}  # engine process: version → pulled, verified weights waiting for the swap
# weights.delta: the trainer's last published buckets (what the next version is diffed against), its deltas not yet
# handed to Dask (store=dask), and an engine's buckets of the version it staged last (what a delta is applied to)
_last: dict = {}
_deltas: dict[int, list[bytes]] = {}
_base: dict = {}


def _key(spec: dict, version: int, index: int, part: str = "b") -> str:
    return f"{spec['prefix']}/v{version}/{part}{index}"  # (part d: the bucket's delta)


def _mooncake(spec: dict):
    from distributed import get_worker

    from rollart_dask.data.weights.mooncake import client, local_hostname

    return client(spec, local_hostname(get_worker().address))


def trainer_publish(version: int, spec: dict, _after=None) -> dict:
    """Bucket the trainer's weights as ``version`` and put them where the store keeps them; drop old versions.
    ``started_at`` (wall clock): where a transfer that follows the Train begins, as no client-side wait can shift it."""
    started_at, t0 = time.time(), time.perf_counter()
    trainer = service(TRAINER)
    state = trainer.state_dict()  # with trainer.lora: the adapter alone
    manifest, blobs = publish_buckets(state, version, int(spec["bucket_mb"] * 2**20))
    manifest["adapter"] = getattr(trainer, "lora", None) is not None
    deltas = _diff(version, blobs, manifest) if spec.get("delta") else None
    if spec["store"] == "mooncake":
        too_big = [e for e in manifest["buckets"] if e["nbytes"] >= spec["buffer_mb"] << 20]
        if too_big:  # one tensor larger than a bucket gets its own, and the transfer buffer must hold it
            e = too_big[0]
            raise ValueError(
                f"weights.mooncake.buffer_mb={spec['buffer_mb']} is too small for tensor {e['names'][0]} "
                f"({e['nbytes'] / 2**20:.0f} MiB in one bucket): raise buffer_mb above it"
            )
        store = _mooncake(spec)
        _keys[version], _blobs[version] = _put(store, spec, version, blobs), list(blobs)
        if deltas is not None:
            _keys[version] += _put(store, spec, version, deltas, part="d")
        for old in [v for v in _keys if v <= version - spec["keep_versions"]]:
            _blobs.pop(old, None)
            for key in _keys.pop(old):
                store.remove(key, True)  # engines moved past it: Update waits for every engine's pull
    else:
        _published[version] = list(blobs)
        if deltas is not None:
            _deltas[version] = deltas
        for old in [v for v in _published if v <= version - spec["keep_versions"]]:
            del _published[old]
        for old in [v for v in _deltas if v <= version - spec["keep_versions"]]:
            del _deltas[old]
    manifest["publish_s"] = time.perf_counter() - t0
    manifest["started_at"] = started_at
    return manifest


def _diff(version: int, blobs: list[bytes], manifest: dict) -> list[bytes] | None:
    """weights.delta: ``version``'s buckets as changes from the version this trainer published last, when that is
    ``version − 1`` and the buckets line up (a re-created trainer has published nothing yet: its first is full only);
    the manifest says what they are a delta of and their sizes. This version is the next one's base."""
    t0, last = time.perf_counter(), dict(_last)
    _last.clear()
    _last.update(version=version, blobs=list(blobs))
    if last.get("version") != version - 1 or not delta.lines_up(last["blobs"], blobs):
        return None
    deltas = [delta.encode(old, new) for old, new in zip(last["blobs"], blobs)]
    nbytes = [len(d) for d in deltas]
    manifest["delta"] = {"of": version - 1, "nbytes": nbytes, "bytes": sum(nbytes), "encode_s": time.perf_counter() - t0}
    return deltas


def _put(store, spec: dict, version: int, blobs: list[bytes], part: str = "b") -> list[str]:
    keys = [_key(spec, version, i, part) for i in range(len(blobs))]
    for key, data in zip(keys, blobs):
        deadline = time.monotonic() + PUT_RETRY_S
        while (rc := store.put(key, data)) != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mooncake put of {key} ({len(data) >> 20} MiB) failed with code {rc} for {PUT_RETRY_S:.0f} s: the master "
                    f"does not answer, or the store is full (weights.mooncake.segment_mb={spec['segment_mb']} per "
                    f"process, {spec['keep_versions']} versions kept)"
                )
            time.sleep(0.5)
    return keys


def trainer_put_again(version: int, spec: dict) -> int:
    """store=mooncake: put ``version``'s buckets again (the master was restarted and knows no object of before)."""
    if version not in _blobs:
        raise KeyError(f"weights v{version} are no longer kept by the trainer (kept: {sorted(_blobs)})")
    _put(_mooncake(spec), spec, version, _blobs[version])
    return version


def trainer_buckets(version: int, _after=None) -> list[bytes]:
    """store=dask: the buckets of ``version`` as one Dask result on the trainer's worker (each engine's stage task
    fetches it peer-to-peer); the trainer's own copy goes, Dask's is freed once the run drops the future."""
    blobs = _published.pop(version, None)
    if blobs is None:
        raise KeyError(f"weights v{version} are no longer held by the trainer (versions held: {sorted(_published)})")
    return blobs


def trainer_delta_buckets(version: int, _after=None) -> list[bytes]:
    """store=dask, weights.delta: the deltas of ``version`` as one Dask result on the trainer's worker (as trainer_buckets)."""
    deltas = _deltas.pop(version, None)
    if deltas is None:
        raise delta.DeltaUnavailable(f"weights v{version} were published without a delta (versions with one: {sorted(_deltas)})")
    return deltas


def _rebuilt(manifest: dict, fetch_delta):
    """fetch(i) for a delta stage: bucket i rebuilt from this engine's base (checked by verify as a full bucket is)."""
    of = (manifest.get("delta") or {}).get("of")
    if of is None or _base.get("version") != of:
        raise delta.DeltaUnavailable(
            f"weights v{manifest['version']}: a delta of v{of} cannot be applied on an engine holding v{_base.get('version')}"
        )
    base = _base["blobs"]
    return lambda i: delta.apply(base[i], fetch_delta(i))


def _stage(manifest: dict, fetch, spec: dict, moved: int | None = None) -> dict:
    """``moved``: the bytes that crossed the network (a delta's), when not the full version's."""
    t0 = time.perf_counter()
    version, weights, blobs = manifest["version"], {}, []
    for i in range(len(manifest["buckets"])):
        data = fetch(i)
        weights.update(verify(manifest, i, data))
        blobs.append(data)
    if spec.get("delta"):  # the next version's delta is applied to these bytes
        _base.clear()
        _base.update(version=version, blobs=blobs)
    emulated = getattr(service(ENGINE), "emulated_pull_s", None)  # EMULATED engines: the profile's weights cross the link too
    if emulated is not None:
        time.sleep(emulated(spec))
    for old in [v for v in _staged if v < version]:
        del _staged[old]
    _staged[version] = weights
    delta_moved = moved is not None
    return {"stage_s": time.perf_counter() - t0, "bytes": moved if delta_moved else manifest["bytes"], "delta": delta_moved}


def engine_stage_dask(manifest: dict, buckets: list[bytes], spec: dict) -> dict:
    """The buckets arrive as this task's dependency (Dask moved them from the trainer's worker)."""
    return _stage(manifest, lambda i: buckets[i], spec)


def engine_stage_dask_delta(manifest: dict, deltas: list[bytes], spec: dict) -> dict:
    """weights.delta: the deltas arrive as this task's dependency; applied to the version this engine staged last."""
    return _stage(manifest, _rebuilt(manifest, lambda i: deltas[i]), spec, moved=sum(map(len, deltas)))


def engine_stage_mooncake(manifest: dict, spec: dict, use_delta: bool = False) -> dict:
    store = _mooncake(spec)

    def fetch(i: int, part: str = "b") -> bytes:
        key = _key(spec, manifest["version"], i, part)
        data = store.get(key)
        if not data:
            raise KeyError(f"mooncake has no {key} (evicted, or garbage-collected: weights.keep_versions={spec['keep_versions']})")
        return data

    if not use_delta:
        return _stage(manifest, fetch, spec)
    return _stage(manifest, _rebuilt(manifest, lambda i: fetch(i, "d")), spec, moved=manifest["delta"]["bytes"])


def engine_swap(version: int) -> int:
    """Update: the staged weights of ``version`` go into the engine (at Resume it generates with them)."""
    weights = _staged.pop(version, None)
    if weights is None:
        raise RuntimeError(f"weights v{version} were not staged on this engine (staged: {sorted(_staged)})")
    return service(ENGINE).update_weights(version, weights)


def engine_swap_batch(items: list[dict], reply=None):
    """Update over the caller's channel: each item names the ``version`` to swap in."""
    return _reply(items, _per_item(lambda item: engine_swap(item["version"]), items), reply)
