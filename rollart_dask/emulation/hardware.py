"""Hardware and model profiles, and the roofline timing formulas the emulated engine,
trainer and ideal calculator share.

Units: seconds, bytes, FLOPs, tokens. All formulas are per engine instance (a tensor-parallel
group of ``tp`` GPUs), ignoring TP communication. Efficiency factors are assumptions, not
measurements: each is a field so an ablation can sweep it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUProfile:
    name: str
    peak_tflops: float  # bf16 dense tensor-core peak
    hbm_gb: float  # HBM capacity, decimal GB (1e9 bytes)
    hbm_tbps: float  # HBM bandwidth, TB/s (1e12 bytes/s)
    nvlink_gbps: float  # NVLink bandwidth, GB/s
    cost: float  # normalised cost, H20 = 1.00
    # Assumptions (typical of vLLM / Megatron on Hopper; not from the paper):
    prefill_mfu: float = 0.5  # fraction of peak a large prefill achieves
    decode_compute_eff: float = 0.5  # fraction of peak for the matmuls of a decode step
    decode_bw_util: float = 0.7  # fraction of HBM bandwidth a decode step achieves
    train_mfu: float = 0.4  # fraction of peak a Megatron training step achieves
    h2d_gbps: float = 50.0  # host-to-device copy for a weight load: PCIe 5.0 x16 (64 GB/s peak), ~80% achieved

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12


# Paper (arXiv 2512.22560), Fig. 4 table: TFLOPS, HBM capacity, HBM bandwidth, NVLink, normalised cost.
H800 = GPUProfile("H800", peak_tflops=989.5, hbm_gb=80, hbm_tbps=3.35, nvlink_gbps=400, cost=2.85)
H20 = GPUProfile("H20", peak_tflops=148, hbm_gb=96, hbm_tbps=4.0, nvlink_gbps=900, cost=1.00)
GPUS = {g.name: g for g in (H800, H20)}


@dataclass(frozen=True)
class ModelProfile:
    """A dense decoder (Qwen3 layout: GQA attention with head_dim, SwiGLU MLP, untied embeddings)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes: int = 2  # bf16 KV cache

    @property
    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 2 * self.head_dim  # q,k,v,o + q/k norms
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        per_layer = attn + mlp + 2 * self.hidden  # + two RMSNorms
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * per_layer + embed + self.hidden

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes  # K and V

    @property
    def attn_flops_per_token_pair(self) -> int:
        """FLOPs for one query token attending to one context token (QK^T and AV, all layers)."""
        return 4 * self.layers * self.heads * self.head_dim


# Public Hugging Face configs (config.json of Qwen/Qwen3-8B, Qwen/Qwen3-14B, Qwen/Qwen3-32B):
# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim=128,
# intermediate_size, vocab_size=151936, tie_word_embeddings=false, torch_dtype=bfloat16.
# The derived ``params`` match the model cards: 8.2B / 14.8B / 32.8B.
QWEN3_8B = ModelProfile("Qwen3-8B", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936)
QWEN3_14B = ModelProfile("Qwen3-14B", layers=40, hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=17408, vocab=151936)
QWEN3_32B = ModelProfile("Qwen3-32B", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, intermediate=25600, vocab=151936)
MODELS = {m.name: m for m in (QWEN3_8B, QWEN3_14B, QWEN3_32B)}


def prefill_seconds(model: ModelProfile, gpu: GPUProfile, tokens: int, tp: int = 1, cached_tokens: int = 0) -> float:
    """Compute-bound: FLOPs / (tp × peak × MFU), with FLOPs = 2·params·tokens (matmuls) +
    causal attention of the new tokens over the cached prefix and themselves. Never below one
    read of the weights (tiny prefills are bandwidth-bound)."""
    if tokens <= 0:
        return 0.0
    return prefill_batch_seconds(model, gpu, prefill_flops(model, tokens, cached_tokens), tp)


def prefill_flops(model: ModelProfile, tokens: int, cached_tokens: int = 0) -> float:
    return 2 * model.params * tokens + model.attn_flops_per_token_pair * tokens * (cached_tokens + tokens / 2)


def prefill_batch_seconds(model: ModelProfile, gpu: GPUProfile, flops: float, tp: int = 1) -> float:
    """Prefills admitted together: their FLOPs add up, the weights are read once."""
    compute = flops / (tp * gpu.peak_flops * gpu.prefill_mfu)
    weights = model.weight_bytes / (tp * gpu.hbm_bytes_per_s * gpu.decode_bw_util)
    return max(compute, weights)


def decode_step_seconds(model: ModelProfile, gpu: GPUProfile, batch: int, context_tokens_total: int, tp: int = 1) -> float:
    """One decode step of ``batch`` sequences holding ``context_tokens_total`` tokens of KV in all.
    Roofline: max(bytes read / achieved bandwidth, FLOPs / achieved compute), bytes = the weights
    once + every sequence's KV; FLOPs = 2·params per sequence + attention over its context.
    Small batches are bandwidth-bound; on H20 (low FLOPs/byte) large batches turn compute-bound."""
    if batch <= 0:
        return 0.0
    bytes_read = model.weight_bytes + model.kv_bytes_per_token * context_tokens_total
    memory = bytes_read / (tp * gpu.hbm_bytes_per_s * gpu.decode_bw_util)
    flops = 2 * model.params * batch + model.attn_flops_per_token_pair * context_tokens_total
    compute = flops / (tp * gpu.peak_flops * gpu.decode_compute_eff)
    return max(memory, compute)


def kv_capacity_tokens(model: ModelProfile, gpu: GPUProfile, tp: int = 1, reserve_fraction: float = 0.1) -> int:
    """Tokens of KV cache an instance holds: (tp × HBM × (1 − reserve) − weights) / KV bytes per token.
    ``reserve_fraction`` stands for activations and runtime (vLLM's gpu_memory_utilization=0.9)."""
    free = tp * gpu.hbm_bytes * (1 - reserve_fraction) - model.weight_bytes
    return max(0, int(free // model.kv_bytes_per_token))


def weight_load_seconds(model: ModelProfile, gpu: GPUProfile, tp: int = 1) -> float:
    """Copying a new set of weights from host memory into the instance's HBM (each GPU its shard)."""
    return model.weight_bytes / tp / (gpu.h2d_gbps * 1e9)


GPUS_PER_NODE = 8  # ASSUMED: a node holds 8 GPUs and one cross-cluster NIC (weight_link_gbps)


def weight_transfer_seconds(model: ModelProfile, generation_gpus: int, train_gpus: int, link_gbps: float | None, pull: str) -> float:
    """A new version from the training cluster to every generation node, across the clusters' links (ASSUMED model):
    ``background`` — through a store (Mooncake): the trainer puts one copy, then every generation node gets its own over
    its own link, all at once: 2 × bytes / link; ``at_update`` — pushed by the trainer with no store: every generation
    node's copy leaves through the training nodes' links: nodes × bytes / (training nodes × link). No link: 0."""
    if link_gbps is None:  # not emulated
        return 0.0
    nodes = lambda gpus: max(1, -(-gpus // GPUS_PER_NODE))  # noqa: E731
    link = link_gbps * 1e9
    if pull == "background":
        return 2 * model.weight_bytes / link
    return nodes(generation_gpus) * model.weight_bytes / (nodes(train_gpus) * link)


def train_step_seconds(model: ModelProfile, gpus: int | list[GPUProfile], tokens: int, gpu: GPUProfile = H800) -> float:
    """6 × params × tokens / (n × peak × MFU): forward (2) + backward (4) FLOPs per parameter per token.
    ``gpus`` is a count of ``gpu`` or a list of profiles (their capacities add up)."""
    pool = [gpu] * gpus if isinstance(gpus, int) else list(gpus)
    capacity = sum(g.peak_flops * g.train_mfu for g in pool)
    if capacity <= 0:
        raise ValueError("train_step_seconds needs at least one GPU")
    return 6 * model.params * tokens / capacity


# ASSUMED (not from the paper): the link a KV cache crosses from a prefill instance to a decode
# instance in prefill/decode disaggregation — one 200 Gb/s RDMA NIC per instance, ~25 GB/s.
KV_LINK_GBPS = 25.0


def kv_transfer_seconds(model: ModelProfile, tokens: int, link_gbps: float = KV_LINK_GBPS) -> float:
    """Shipping ``tokens`` of KV cache (K and V, every layer) over a link of ``link_gbps`` GB/s."""
    return model.kv_bytes_per_token * tokens / (link_gbps * 1e9)
