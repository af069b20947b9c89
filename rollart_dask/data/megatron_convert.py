"""HF ↔ Megatron weights for the megatron trainer backend (``trainer_megatron``): the supported
architectures, the name and layout conversion, and tensor/pipeline sharding. Pure torch, no megatron import.

* q/k/v → ``linear_qkv`` in Megatron's per-group layout: for each of the ``num_query_groups``
  KV groups, the rows of its query heads, then its key head, then its value head. This layout
  is what lets tensor parallelism cut ``linear_qkv`` into contiguous row blocks per rank.
* gate/up → ``linear_fc1`` as ``[gate; up]`` (Megatron's gated linear unit: first half gated by
  SiLU, times the second half); down → ``linear_fc2``.
* ``input_layernorm`` / ``pre_mlp_layernorm`` / ``final_layernorm`` hold the RMSNorm weights.
* The vocabulary is padded to a multiple of tp (vocab-parallel embedding needs it); padding
  rows are zero and dropped on the way back, so HF → Megatron → HF is exact.
"""

from __future__ import annotations

import torch

SUPPORTED = ("llama", "qwen2")


# -- HF config checks --------------------------------------------------------------------------
def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}  # transformers 5 keeps it here
    rope_type = params.get("rope_type", "default")
    scaling = getattr(hf_config, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default"):
        raise ValueError(
            f"megatron backend: RoPE scaling {rope_type!r} of this {hf_config.model_type} model is not supported (plain RoPE only)"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def check_hf_config(hf_config, tp: int = 1, pp: int = 1) -> None:
    """Raise a ValueError naming what does not fit: the architecture, or tp/pp against its shape."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(
            f"megatron backend: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED)} "
            "(Llama/SmolLM2 and Qwen2 families: RMSNorm, SwiGLU, RoPE, GQA)"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron backend: hidden_act {hf_config.hidden_act!r} is not supported (SwiGLU with silu only)")
    if mt == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise ValueError(
            "megatron backend: Llama with attention_bias/mlp_bias is not supported (o_proj/MLP biases have no Megatron slot here)"
        )
    if mt == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("megatron backend: Qwen2 with use_sliding_window=true is not supported")
    _rope_theta(hf_config)
    heads, groups = hf_config.num_attention_heads, _kv_heads(hf_config)
    if tp < 1 or pp < 1:
        raise ValueError(f"megatron backend: tp and pp must be >= 1 (got tp={tp}, pp={pp})")
    if heads % tp or groups % tp:
        raise ValueError(f"megatron backend: tp={tp} must divide the attention heads ({heads}) and the KV heads ({groups})")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"megatron backend: pp={pp} must divide the layers ({hf_config.num_hidden_layers})")


def _kv_heads(c) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def padded_vocab(hf_config, tp: int = 1) -> int:
    return -(-hf_config.vocab_size // tp) * tp


# -- weights: HF ↔ Megatron (unsharded, tp=pp=1 names) ----------------------------------------------
def _fuse_qkv(q, k, v, groups: int):
    per = q.shape[0] // groups  # query rows per KV group
    kv = k.shape[0] // groups
    parts = [q.reshape(groups, per, *q.shape[1:]), k.reshape(groups, kv, *k.shape[1:]), v.reshape(groups, kv, *v.shape[1:])]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(qkv, hf_config):
    groups, hd = _kv_heads(hf_config), _head_dim(hf_config)
    per = hf_config.num_attention_heads // groups * hd
    x = qkv.reshape(groups, per + 2 * hd, *qkv.shape[1:])
    q, k, v = torch.split(x, [per, hd, hd], dim=1)
    return (t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def _pad_rows(w, rows: int):
    return w if w.shape[0] == rows else torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def hf_to_megatron(state_dict: dict, hf_config, tp: int = 1) -> dict:
    """HF Llama/Qwen2 state dict → full (unsharded) Megatron GPTModel state dict."""
    check_hf_config(hf_config, tp)
    sd, out = state_dict, {}
    groups, vocab = _kv_heads(hf_config), padded_vocab(hf_config, tp)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out["embedding.word_embeddings.weight"] = _pad_rows(sd["model.embed_tokens.weight"], vocab)
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"], groups
        )
        if a + "q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                sd[a + "q_proj.bias"], sd[a + "k_proj.bias"], sd[a + "v_proj.bias"], groups
            )
        out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if not tied:  # tied: Megatron's output layer reads the embedding (HF's lm_head.weight is the same tensor)
        out["output_layer.weight"] = _pad_rows(sd["lm_head.weight"], vocab)
    return out


def megatron_to_hf(state_dict: dict, hf_config) -> dict:
    """Full Megatron GPTModel state dict → HF names and shapes (the keys an HF model's state_dict() has,
    ``lm_head.weight`` included when tied, as transformers lists it)."""
    sd, out, vocab = state_dict, {}, hf_config.vocab_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out["model.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"][:vocab]
    ffn = hf_config.intermediate_size
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = _split_qkv(
            sd[m + "self_attention.linear_qkv.weight"], hf_config
        )
        if m + "self_attention.linear_qkv.bias" in sd:
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = _split_qkv(
                sd[m + "self_attention.linear_qkv.bias"], hf_config
            )
        out[a + "o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = torch.split(sd[m + "mlp.linear_fc1.weight"], [ffn, ffn])
        out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"] if tied else sd["output_layer.weight"][:vocab]
    return {k: v.contiguous() for k, v in out.items()}


# -- tensor / pipeline sharding of the full Megatron state dict -------------------------------------
def _layer_range(hf_config, pp: int, pp_rank: int) -> range:
    n = hf_config.num_hidden_layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def _tp_dim(name: str) -> int | None:
    """Which dimension tensor parallelism cuts (None: replicated)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0  # column-parallel (vocab-parallel for the embedding/output)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1  # row-parallel
    return None


def shard_megatron(state_dict: dict, hf_config, tp: int, pp: int, tp_rank: int, pp_rank: int) -> dict:
    """The part of a full Megatron state dict that rank (tp_rank, pp_rank) holds, in its local names."""
    layers = _layer_range(hf_config, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = {}
    for name, w in state_dict.items():
        if name.startswith("decoder.layers."):
            i = int(name.split(".")[2])
            if i not in layers:
                continue
            name = f"decoder.layers.{i - layers.start}." + name.split(".", 3)[3]  # layers are numbered per stage
        elif name.startswith("embedding.") and not first:
            if not (tied and last):
                continue
            name = "output_layer.weight"  # tied with pp > 1: the last stage keeps its own copy of the embedding
        elif name.startswith(("decoder.final_layernorm", "output_layer")) and not last:
            continue
        dim = _tp_dim(name)
        if dim is None or tp == 1:
            out[name] = w
        elif name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds [gate_r; up_r]
            gate, up = w.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
        else:
            out[name] = w.chunk(tp, dim=dim)[tp_rank]
    return out


def unshard_megatron(shards: dict, hf_config, tp: int, pp: int) -> dict:
    """Inverse of shard_megatron: ``shards[(tp_rank, pp_rank)]`` → the full state dict."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = {}
    for pp_rank in range(pp):
        start = _layer_range(hf_config, pp, pp_rank).start
        for name in shards[(0, pp_rank)]:
            parts = [shards[(r, pp_rank)][name] for r in range(tp)]
            dim = _tp_dim(name)
            if dim is None or tp == 1:
                w = parts[0]
            elif name.endswith("linear_fc1.weight"):
                halves = [p.chunk(2, dim=0) for p in parts]
                w = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            else:
                w = torch.cat(parts, dim=dim)
            if name.startswith("decoder.layers."):
                i = int(name.split(".")[2])
                name = f"decoder.layers.{i + start}." + name.split(".", 3)[3]
            elif name == "output_layer.weight" and tied:
                continue  # the last stage's copy of the tied embedding
            out[name] = w
    return out
