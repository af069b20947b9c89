"""megatron-core trainer backend (``trainer.backend: megatron``).

The policy is a Megatron ``GPTModel`` built from the Hugging Face config of the run's model
(Llama and Qwen2 families: RMSNorm, SwiGLU, RoPE, GQA, tied or untied embeddings, Qwen2's
q/k/v bias). Weights come in from the HF directory and go out (``state_dict()``, checkpoints)
in HF names, so engines and the weight store see exactly what the torch trainer gives them.
The loss is the same GRPO / PPO-clip loss: ``MegatronTrainer`` reuses ``TorchTrainer``'s batching
and update loop and replaces only the forward pass and the optimizer.

Weight conversion HF ↔ Megatron and its tp/pp sharding are pure torch, in ``megatron_convert``.

Where it runs: megatron-core is a GPU library. On a CPU-only torch, forward and backward work
inside ``cpu_redirect()`` (its hard ``torch.cuda`` calls go to the CPU) with torch AdamW as the
optimizer; on a GPU, Megatron's DDP wrapper and ``get_megatron_optimizer`` do the update.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path

import torch

from rollart_dask.algo.losses import LOSSES
from rollart_dask.data.megatron_convert import (
    _head_dim,
    _kv_heads,
    _rope_theta,
    check_hf_config,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab,
    shard_megatron,
)
from rollart_dask.data.megatron_convert import SUPPORTED, unshard_megatron  # noqa: F401  (tests and deploy/gpu reach them here)
from rollart_dask.data.trainer_torch import TorchTrainer

INSTALL_HINT = "pip install -e '.[megatron]' (megatron-core==0.16.1)"


# -- HF config → Megatron settings -------------------------------------------------------------
def megatron_config_from_hf(hf_config, tp: int = 1, pp: int = 1, params_dtype=torch.float32, on_cpu: bool | None = None):
    """(TransformerConfig, GPTModel keyword arguments) for this HF config at these parallel sizes."""
    check_hf_config(hf_config, tp, pp)
    TransformerConfig = require_megatron().TransformerConfig
    on_cpu = (not torch.cuda.is_available()) if on_cpu is None else on_cpu
    with warnings.catch_warnings():  # megatron's own deprecation notice about its cuda-graph default; nothing we set
        warnings.simplefilter("ignore", UserWarning)
        cfg = _transformer_config(TransformerConfig, hf_config, tp, pp, params_dtype, on_cpu)
    gpt_kwargs = dict(
        vocab_size=padded_vocab(hf_config, tp),
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_output=False,  # full-vocabulary logits: the loss restricts to allowed ids over the whole vocabulary
    )
    return cfg, gpt_kwargs


def _transformer_config(TransformerConfig, hf_config, tp, pp, params_dtype, on_cpu):
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=_kv_heads(hf_config),
        kv_channels=_head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,  # SwiGLU
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=0.0,  # HF models here train without dropout; the ratio needs the same forward
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # weights are loaded right after
    )


# -- megatron-core import and the CPU redirection ------------------------------------------------------
def require_megatron():
    """Import megatron-core's pieces, or raise naming the pip extra that installs it."""
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected, the local spec is used
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state, tensor_parallel
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_local_spec,
            )
            from megatron.core.models.gpt.gpt_model import GPTModel
            from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise RuntimeError(f"trainer.backend=megatron needs megatron-core: {INSTALL_HINT} ({e})") from None
    import types

    return types.SimpleNamespace(
        parallel_state=parallel_state,
        tensor_parallel=tensor_parallel,
        GPTModel=GPTModel,
        TransformerConfig=TransformerConfig,
        local_spec=get_gpt_layer_local_spec,
    )


_redirect_lock = threading.Lock()
_redirect_depth = 0
_redirect_stack: contextlib.ExitStack | None = None


@contextlib.contextmanager
def cpu_redirect():
    """CPU ONLY (tests, CPU boxes): megatron-core calls torch.cuda directly (current_device for the
    RoPE buffer, the model-parallel RNG tracker's get/set state, synchronize). On a CPU-only torch
    these raise, so inside this context they act on the CPU instead. Reentrant; a no-op with CUDA."""
    global _redirect_depth, _redirect_stack
    if torch.cuda.is_available():
        yield
        return
    from unittest import mock

    with _redirect_lock:
        if _redirect_depth == 0:
            from megatron.core.tensor_parallel import random as mrandom

            stack = contextlib.ExitStack()
            for target, fn in [
                ("torch.cuda.current_device", lambda: torch.device("cpu")),
                ("torch.cuda.synchronize", lambda *a, **k: None),
                ("torch.cuda.get_rng_state", lambda *a, **k: torch.get_rng_state()),
                ("torch.cuda.manual_seed", lambda seed: torch.manual_seed(seed)),
            ]:
                stack.enter_context(mock.patch(target, fn))
            stack.enter_context(mock.patch.object(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()))
            stack.enter_context(mock.patch.object(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)))
            _redirect_stack = stack
        _redirect_depth += 1
    try:
        yield
    finally:
        with _redirect_lock:
            _redirect_depth -= 1
            if _redirect_depth == 0:
                _redirect_stack.close()
                _redirect_stack = None


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0):
    """torch.distributed (nccl on GPU, gloo on CPU) and Megatron's model-parallel groups for tp × pp ranks.
    A single process (the Dask trainer worker) is world size 1; more ranks need a multi-process launch."""
    import torch.distributed as dist

    mc = require_megatron()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before nccl: one GPU per rank
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            import socket

            with socket.socket() as s:  # a free port for a one-process group
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init = f"tcp://127.0.0.1:{port}"
        else:
            init = "env://"
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            init_method=init,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    world = dist.get_world_size()
    if world != tp * pp:
        raise RuntimeError(
            f"megatron backend: tp={tp} × pp={pp} needs {tp * pp} ranks, this process group has {world} "
            "(the trainer runs in one Dask worker process: tp=pp=1 there)"
        )
    ps = mc.parallel_state
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"megatron model-parallel groups already set up with tp, pp = {have}, asked for {(tp, pp)}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    with cpu_redirect():
        mc.tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return mc


def build_gpt(hf_config, tp: int = 1, pp: int = 1, params_dtype=torch.float32):
    """A GPTModel (this rank's stage) for the HF config; init_parallel must have run."""
    mc = require_megatron()
    cfg, kw = megatron_config_from_hf(hf_config, tp, pp, params_dtype)
    ps = mc.parallel_state
    with cpu_redirect():
        model = mc.GPTModel(
            cfg,
            mc.local_spec(normalization="RMSNorm"),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **kw,
        )
    return model


def load_megatron_weights(model, weights: dict) -> None:
    """Load a (local, possibly sharded) Megatron state dict; every parameter must be set."""
    target = model.module if hasattr(model, "module") else model
    missing, unexpected = target.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """Megatron's mask convention: True = masked out. Passed explicitly: its default mask is built on 'cuda'.
    Right padding needs no more than causality (no real token attends to a later pad)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def gpt_logits(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, T, vocab] logits of a tp=·, pp=1 GPTModel (padding columns of the vocabulary dropped)."""
    pos = torch.arange(ids.size(1), device=ids.device).unsqueeze(0).expand_as(ids)
    with cpu_redirect():
        out = model(ids, pos, attention_mask=causal_mask(ids.size(1), ids.device))
    return out[..., :vocab]


# -- the trainer -----------------------------------------------------------------------------------
class MegatronTrainer(TorchTrainer):
    """TorchTrainer's contract (train_step, sft_step, warm_start, state_dict in HF names, HF checkpoints,
    restore, version) on a Megatron GPTModel. Only the forward pass, the optimizer and the weight
    conversion differ; batching, micro-batches and the GRPO loss are TorchTrainer's own."""

    def __init__(
        self,
        model_dir: str,
        lr: float,
        weight_decay: float = 0.0,
        clip: float = 0.2,
        entropy_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        temperature: float = 1.0,
        seed: int = 0,
        micro_batch_tokens: int = 8192,
        loss: str = "ppo_clip",
        tp: int = 1,
        pp: int = 1,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        from rollart_dask.models.tiny import load_tokenizer

        torch.manual_seed(seed)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        check_hf_config(self.hf_config, tp, pp)
        if pp > 1:
            raise NotImplementedError("megatron backend: pp > 1 needs Megatron's pipeline schedule across ranks; train_step runs pp=1")
        self.tp, self.pp = tp, pp
        init_parallel(tp, pp, seed)  # sets this rank's GPU first
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.gpt = build_gpt(self.hf_config, tp, pp)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        load_megatron_weights(self.gpt, self._local(hf_to_megatron(hf, self.hf_config, tp)))
        del hf
        self.gpt.train()
        self.lr, self.weight_decay = lr, weight_decay
        self.clip, self.entropy_coef, self.max_grad_norm, self.temperature = clip, entropy_coef, max_grad_norm, temperature
        self.micro_batch_tokens = micro_batch_tokens
        self.policy_loss = LOSSES.get(loss)
        self.model = self.gpt  # what TorchTrainer's loop calls parameters() on
        if self.device.type == "cuda":  # Megatron's DDP holds the gradient buffers its optimizer steps from
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
            )

            self.model = DistributedDataParallel(self.gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), self.gpt)
        self.opt = self._make_optimizer()
        self.version = 0

    @staticmethod
    def _backend_options(cfg) -> dict:
        return {"tp": cfg.megatron.tp, "pp": cfg.megatron.pp}

    def _local(self, full: dict) -> dict:
        """This rank's shard of a full Megatron state dict (all of it at tp=pp=1)."""
        ps = require_megatron().parallel_state
        return shard_megatron(
            full, self.hf_config, self.tp, self.pp, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        )

    # -- the hooks TorchTrainer's update loop calls
    def _vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def _decoder_and_head(self):
        return None, None  # (a GPTModel's forward: _logits below)

    def _logits(self, ids, attn):
        # Back on the CPU because TorchTrainer builds targets/masks there (fine for the small models we run;
        # a large-model GPU run would move the batch tensors to the device instead).
        return gpt_logits(self.model, ids.to(self.device), self.hf_config.vocab_size).float().cpu()

    def _make_optimizer(self):
        if self.device.type != "cuda":
            # get_megatron_optimizer hard-codes device='cuda' (its grad buffers and norms): on CPU, torch AdamW
            # over the model's parameters, exactly the torch trainer's update.
            return torch.optim.AdamW(self.gpt.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            weight_decay=self.weight_decay,
            clip_grad=self.max_grad_norm,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            params_dtype=torch.float32,
        )
        return get_megatron_optimizer(cfg, [self.model])

    def _zero_grad(self):
        if self.device.type == "cuda":
            self.model.zero_grad_buffer()  # DDP's main_grad buffers, which Megatron's optimizer reads
        self.opt.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        if self.device.type != "cuda":
            return super()._optimizer_step()
        self.model.finish_grad_sync()
        ok, grad_norm, _ = self.opt.step()  # clips to clip_grad inside
        return float(grad_norm) if ok else float("nan")  # skipped on non-finite gradients: the caller counts it

    # -- weights out / in, always in HF names
    def megatron_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.tp * self.pp > 1:
            raise NotImplementedError("megatron backend: publishing weights from tp/pp shards needs a gather across ranks")
        return {k: v.detach().to("cpu", copy=True) for k, v in megatron_to_hf(self.megatron_state_dict(), self.hf_config).items()}

    def load_hf_weights(self, hf_state: dict) -> None:
        """HF weights (a saved directory may omit lm_head.weight when tied: it is not read then)."""
        load_megatron_weights(self.gpt, self._local(hf_to_megatron(hf_state, self.hf_config, self.tp)))

    def save_checkpoint(self, path: str | Path) -> str:
        import json

        from transformers import AutoModelForCausalLM

        from rollart_dask.data.weights.buckets import check_finite

        state = self.state_dict()
        check_finite(state, f"checkpoint of version {self.version}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with torch.device("meta"):  # an HF skeleton to write the directory engines and TorchTrainer load
            hf = AutoModelForCausalLM.from_config(self.hf_config)
        hf.load_state_dict(state, assign=True)
        hf.tie_weights()  # assign=True gave lm_head its own copy; tied, the directory must hold one tensor as HF writes it
        hf.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        torch.save({"optimizer": self.opt.state_dict(), "version": self.version, "backend": "megatron"}, path / "trainer_state.pt")
        (path / "rollart.json").write_text(json.dumps({"version": self.version}))
        return str(path)

    def restore(self, path: str | Path) -> int:
        from safetensors.torch import load_file

        path = Path(path)
        self.load_hf_weights(load_file(str(path / "model.safetensors")))
        state = torch.load(path / "trainer_state.pt", weights_only=True)  # (never unpickles code: a shared run directory is not trusted)
        self.opt.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        return self.version
