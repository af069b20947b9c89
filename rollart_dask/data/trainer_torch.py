"""Torch GRPO trainer: the long-lived learner living in its own worker (TRAIN pool).

``train_step(samples) -> metrics`` runs one optimizer update on a batch of per-turn samples
(prompt ids, response ids, behaviour log-probs, allowed ids, advantage) and increments the
policy version; ``state_dict()`` is what engines pull; checkpoints are Hugging Face
directories (safetensors + config + tokenizer) plus the optimizer state. With ``lora`` the
base is frozen and only a peft adapter trains: ``state_dict()`` and checkpoints are the adapter
alone (data/lora.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollart_dask.algo.losses import LOSSES, aggregation_weights, masked_logprobs_and_entropy, off_policy
from rollart_dask.data.backends import set_torch_threads

if TYPE_CHECKING:
    from rollart_dask.config import EmulationConfig, LoraConfig, TrainerConfig

NONFINITE_LIMIT = 3  # NaN/inf updates in a row that stop the run (one alone is skipped and counted)


class NonFiniteUpdate(RuntimeError):
    """The loss or gradient was NaN/inf at NONFINITE_LIMIT updates in a row: training cannot go on."""


class TorchTrainer:
    version: int  # the Trainer contract's attribute (data/contracts.py)
    correction, is_cap, is_level = "none", 2.0, "token"  # trainer.correction (from_config sets them; algo/losses.off_policy)
    lora: LoraConfig | None = None  # trainer.lora: the adapter alone trains and is published
    loss_agg, loss_norm_tokens = "token_mean", None  # trainer.loss_agg (from_config sets them; algo/losses.aggregation_weights)
    nonfinite_in_a_row = 0  # updates skipped for a NaN/inf loss or gradient since the last applied one
    shared_prompt = False  # trainer.shared_prompt: a prompt shared by several samples runs once (_shared_prompt_logits)

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
        lora: LoraConfig | None = None,
    ):
        from transformers import AutoModelForCausalLM

        from rollart_dask.models.tiny import load_tokenizer

        torch.manual_seed(seed)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.lora = lora
        if lora is not None:
            from rollart_dask.data import lora as adapters

            self.model = adapters.wrap(self.model, lora, model_dir)
        self.model.train()
        self.lr, self.weight_decay = lr, weight_decay
        self.opt = self._make_optimizer()
        self.clip, self.entropy_coef, self.max_grad_norm, self.temperature = clip, entropy_coef, max_grad_norm, temperature
        self.micro_batch_tokens = micro_batch_tokens
        self.policy_loss = LOSSES.get(loss)  # an unknown name fails here, at build, naming the registered ones
        self.version = 0

    @classmethod
    def from_config(
        cls, cfg: TrainerConfig, *, model_dir: str, seed: int = 0, temperature: float = 1.0, emulation: EmulationConfig | None = None
    ) -> TorchTrainer:
        set_torch_threads()
        trainer = cls(
            model_dir,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            clip=cfg.clip,
            entropy_coef=cfg.entropy_coef,
            max_grad_norm=cfg.max_grad_norm,
            micro_batch_tokens=cfg.micro_batch_tokens,
            loss=cfg.loss,
            temperature=temperature,
            seed=seed,
            **cls._backend_options(cfg),
        )
        trainer.correction, trainer.is_cap, trainer.is_level = cfg.correction, cfg.is_cap, cfg.is_level
        trainer.loss_agg, trainer.loss_norm_tokens = cfg.loss_agg, cfg.loss_norm_tokens
        trainer.shared_prompt = cfg.shared_prompt
        return trainer

    @staticmethod
    def _backend_options(cfg: TrainerConfig) -> dict:
        """Keys of the trainer section only this backend reads (here LoRA; MegatronTrainer: its parallel layout)."""
        return {"lora": cfg.lora}

    def _tensors(self, samples: list[dict]):
        """Pad a batch. Samples with the same input (prompt + all but the last response token)
        share one forward row: their logits are identical, only targets and advantages differ."""
        n = len(samples)
        unique: dict[tuple, int] = {}
        row = [unique.setdefault(tuple(s["prompt_ids"] + s["response_ids"][:-1]), len(unique)) for s in samples]
        width = max(len(k) for k in unique)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(unique), width), pad, dtype=torch.long)
        attn = torch.zeros((len(unique), width), dtype=torch.long)
        for seq, u in unique.items():
            ids[u, : len(seq)] = torch.tensor(seq)
            attn[u, : len(seq)] = 1
        vocab = self._vocab_size()
        resp_width = max(len(s["response_ids"]) for s in samples)
        targets = torch.zeros((n, resp_width), dtype=torch.long)
        old = torch.zeros((n, resp_width))
        mask = torch.zeros((n, resp_width), dtype=torch.bool)
        pos_index = torch.zeros((n, resp_width), dtype=torch.long)
        allowed = torch.ones((n, resp_width, vocab), dtype=torch.bool) if any(s.get("allowed_ids") for s in samples) else None
        for i, s in enumerate(samples):
            p, r = len(s["prompt_ids"]), len(s["response_ids"])
            targets[i, :r] = torch.tensor(s["response_ids"])
            old[i, :r] = torch.tensor(s["logprobs"])
            mask[i, :r] = True
            pos_index[i, :r] = torch.arange(p - 1, p - 1 + r)  # logits at t predict token t+1
            if allowed is not None and s.get("allowed_ids"):
                for t, ids_t in enumerate(s["allowed_ids"]):
                    allowed[i, t] = False
                    allowed[i, t, ids_t] = True
        adv = torch.tensor([float(s["advantage"]) for s in samples])
        return ids, attn, torch.tensor(row), targets, old, mask, allowed, pos_index, adv

    def micro_batches(self, samples: list[dict]) -> list[list[dict]]:
        """Samples sorted by length and cut at ``micro_batch_tokens`` padded tokens: tasks with
        short and long prompts no longer pad each other to the longest (compute ∝ rows × width)."""
        order = sorted(samples, key=lambda s: len(s["prompt_ids"]) + len(s["response_ids"]))
        chunks: list[list[dict]] = [[]]
        for s in order:
            width = len(s["prompt_ids"]) + len(s["response_ids"])
            if chunks[-1] and (len(chunks[-1]) + 1) * width > self.micro_batch_tokens:
                chunks.append([])
            chunks[-1].append(s)
        return chunks

    def train_step(self, samples: list[dict]) -> dict:
        """One optimizer update with the configured loss (trainer.loss) aggregated by trainer.loss_agg; the policy
        version goes up by one."""

        def loss_fn(logp, entropy, old, mask, adv, token_weights):
            old, weights, mask, is_stats = off_policy(self.correction, logp, old, mask, self.is_cap, self.is_level)
            loss, stats = self.policy_loss(
                logp=logp,
                old_logp=old,
                advantages=adv,
                mask=mask,
                clip=self.clip,
                entropy=entropy,
                entropy_coef=self.entropy_coef,
                is_weights=weights,
                token_weights=token_weights,
            )
            return loss, {**stats, **is_stats}

        stats = self._update(samples, loss_fn, agg=self.loss_agg)
        self.version += 1
        return {**stats, "version": self.version}

    def sft_step(self, samples: list[dict]) -> dict:
        """One imitation update: token-level NLL of the demonstrated responses, under the same
        allowed-id restriction the engine decodes with (the policy distribution RL trains)."""

        def loss_fn(logp, entropy, old, mask, adv, token_weights):  # imitation stays a token mean
            m = mask.float()
            nll = -(logp * m).sum() / m.sum().clamp(min=1.0)
            return nll, {"nll": nll.item(), "entropy": ((entropy * m).sum() / m.sum().clamp(min=1.0)).item()}

        return self._update(samples, loss_fn)

    def warm_start(
        self, demos: list[dict], steps: int, batch_size: int, lr: float, seed: int = 0, shares: dict[str, float] | None = None
    ) -> dict:
        """Imitation of expert demonstrations before RL. Each batch takes from every task its
        share (``shares``, default equal) whatever its turns per episode. Counts as one published
        version (the policy RL starts from); the optimizer is then rebuilt so RL starts without
        SFT moments."""
        import random

        from rollart_dask.data.encoding import choice_trie, demo_sample

        t0 = time.perf_counter()
        tries: dict = {}
        samples, skipped = [], 0
        for d in demos:
            choices = tuple(d["choices"]) if d.get("choices") else None
            if choices and choices not in tries:
                tries[choices] = choice_trie(self.tokenizer, choices)
            s = demo_sample(self.tokenizer, d["prompt"], d["action"], choices, d.get("max_tokens", 16), tries.get(choices))
            if s is None:
                skipped += 1
                continue
            samples.append({**s, "logprobs": [0.0] * len(s["response_ids"]), "advantage": 0.0, "task": d.get("task")})
        if not samples:
            raise ValueError(f"warm start: none of the {len(demos)} demonstrations fits the engine's decoding (choices / max_tokens)")
        by_task: dict = {}
        for s in samples:
            by_task.setdefault(s["task"], []).append(s)
        weights = {t: shares.get(t, 0.0) for t in by_task} if shares else {t: 1.0 for t in by_task}
        total = sum(weights.values()) or 1.0
        quota = {t: max(1, round(batch_size * w / total)) for t, w in weights.items() if w > 0}
        rng = random.Random(seed)
        for g in self.opt.param_groups:
            g["lr"] = lr
        first = last = {}
        for step in range(steps):
            batch = [s for t, k in quota.items() for s in rng.sample(by_task[t], min(k, len(by_task[t])))]
            last = self.sft_step(batch)
            first = first or last
        self.opt = self._make_optimizer()
        self.version += 1
        return {
            "demos": len(demos),
            "samples": len(samples),
            "skipped": skipped,
            "steps": steps,
            "lr": lr,
            "batch_per_task": quota,
            "nll_first": first.get("nll"),
            "nll_last": last.get("nll"),
            "seconds": time.perf_counter() - t0,
            "version": self.version,
        }

    def _update(self, samples: list[dict], loss_fn, agg: str = "token_mean") -> dict:
        """One optimizer update; gradients accumulate over micro-batches, each weighted by its
        share of response tokens: the loss is the token-level mean over the whole batch, or with
        ``agg`` (trainer.loss_agg) the token weights make it that aggregate (algo/losses.aggregation_weights)."""
        t0 = time.perf_counter()
        total_tokens = sum(len(s["response_ids"]) for s in samples)
        norm_tokens = self.loss_norm_tokens or max(len(s["response_ids"]) for s in samples)
        self._zero_grad()
        stats: dict[str, float] = {}
        loss_sum, rows = 0.0, 0
        for chunk in self.micro_batches(samples):
            ids, attn, row, targets, old, mask, allowed, pos_index, adv = self._tensors(chunk)
            shared = self._shared_prompt_logits(chunk, targets.size(1)) if self.shared_prompt else None
            logits = shared if shared is not None else self._response_logits(ids, attn, row, pos_index)
            logp, entropy = masked_logprobs_and_entropy(logits, targets, allowed, self.temperature)
            token_weights = aggregation_weights(mask, agg, len(samples), total_tokens, norm_tokens)
            loss, chunk_stats = loss_fn(logp, entropy, old, mask, adv, token_weights)
            w = float(mask.sum()) / max(total_tokens, 1)
            (loss * w).backward()
            loss_sum += loss.item() * w
            rows += int(ids.size(0))
            for k, v in chunk_stats.items():
                stats[k] = stats.get(k, 0.0) + v * w
        # a NaN/inf loss or gradient is never applied: the update is skipped and counted, and a few in a row stop the run
        grad_norm = self._optimizer_step() if math.isfinite(loss_sum) else float("nan")
        finite = math.isfinite(loss_sum) and math.isfinite(grad_norm)
        if not finite:
            self._zero_grad()
        self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
        if self.nonfinite_in_a_row >= NONFINITE_LIMIT:
            raise NonFiniteUpdate(
                f"trainer: the loss or gradient was NaN/inf at {self.nonfinite_in_a_row} updates in a row, the last "
                f"the update after version {self.version} (loss {loss_sum}, grad norm {grad_norm}); none was applied. "
                f"Look for non-finite advantages, logprobs or a learning rate that diverges"
            )
        stats.update(
            loss=loss_sum,
            grad_norm=float(grad_norm),
            samples=len(samples),
            tokens=total_tokens,
            forward_rows=rows,
            train_s=time.perf_counter() - t0,
            nonfinite_skipped=int(not finite),
        )
        return stats

    # -- the model-specific steps of the update (MegatronTrainer overrides them; the loss stays here)
    def _vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _response_logits(self, ids: torch.Tensor, attn: torch.Tensor, row: torch.Tensor, pos_index: torch.Tensor) -> torch.Tensor:
        """The logits [N, T, V] that predict each sample's response tokens. The LM head runs on those positions alone: on a
        prompt longer than its answer, projecting every position onto the vocabulary was most of the head's work."""
        decoder, head = self._decoder_and_head()
        if decoder is None:
            logits = self._logits(ids, attn)[row]
            return logits.gather(1, pos_index.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
        hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state[row]
        return head(hidden.gather(1, pos_index.unsqueeze(-1).expand(-1, -1, hidden.size(-1))))

    def _shared_prompt_logits(self, samples: list[dict], width: int) -> torch.Tensor | None:
        """The response logits [N, width, V] with each distinct prompt run once: its keys and values (all but its last
        token) are repeated for the samples that share it, whose rows hold only the last prompt token and their response.
        Causal attention makes these the logits of the full rows. None where the model cannot be split so (the whole
        forward then runs per sample)."""
        decoder, head = self._decoder_and_head()
        if decoder is None:
            return None
        from transformers import DynamicCache

        pad = self.tokenizer.pad_token_id
        by_prompt: dict[tuple, list[int]] = {}
        for i, s in enumerate(samples):
            by_prompt.setdefault(tuple(s["prompt_ids"]), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for prompt, members in by_prompt.items():
            rows = [[prompt[-1], *samples[i]["response_ids"][:-1]] for i in members]
            w = max(map(len, rows))
            ids = torch.tensor([r + [pad] * (w - len(r)) for r in rows])
            attn = torch.tensor([[1] * len(r) + [0] * (w - len(r)) for r in rows])
            if len(prompt) > 1:
                cache = DynamicCache()
                decoder(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
                cache.batch_repeat_interleave(len(members))
                attn = torch.cat([torch.ones(len(members), len(prompt) - 1, dtype=attn.dtype), attn], 1)
                hidden = decoder(input_ids=ids, attention_mask=attn, past_key_values=cache, use_cache=True).last_hidden_state
            else:
                hidden = decoder(input_ids=ids, attention_mask=attn).last_hidden_state
            for k, i in enumerate(members):
                out[i] = hidden[k, :width] if w >= width else torch.nn.functional.pad(hidden[k], (0, 0, 0, width - w))
        return head(torch.stack(out))

    def _decoder_and_head(self):
        """The decoder stack and the LM head of a plain causal LM (None when the head does more than project, as with a
        logit soft-cap, or the model is not built that way: then the whole forward runs)."""
        try:
            config = self.model.config
            if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
                return None, None
            return self.model.get_decoder(), self.model.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return None, None

    def _logits(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=attn).logits

    def _make_optimizer(self):
        params = [p for p in self.model.parameters() if p.requires_grad]  # with LoRA: the adapter's alone
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def _zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        """Clip and step; the gradient norm. A non-finite norm: no step (the caller counts it)."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if math.isfinite(grad_norm):
            self.opt.step()
        return grad_norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.lora is not None:
            from rollart_dask.data.lora import adapter_state

            return adapter_state(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str | Path) -> str:
        """A Hugging Face model directory; with LoRA an adapter directory (peft's and vLLM's format) whose
        config names the base model, which ``rollart merge`` folds it into."""
        from rollart_dask.data.weights.buckets import check_finite

        check_finite(self.state_dict(), f"checkpoint of version {self.version}")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        torch.save({"optimizer": self.opt.state_dict(), "version": self.version}, path / "trainer_state.pt")
        (path / "rollart.json").write_text(json.dumps({"version": self.version, "lora": self.lora is not None, "base": self.model_dir}))
        return str(path)

    def restore(self, path: str | Path) -> int:
        from safetensors.torch import load_file

        from rollart_dask.data import lora as adapters

        path = Path(path)
        if adapters.is_adapter_dir(path) != (self.lora is not None):
            raise ValueError(
                f"checkpoint {path} {'holds a LoRA adapter' if adapters.is_adapter_dir(path) else 'holds full weights'}, "
                f"but this run {'trains' if self.lora is not None else 'does not train'} one (trainer.lora)"
            )
        if self.lora is not None:
            adapters.load_adapter(self.model, load_file(str(path / adapters.ADAPTER_FILE)))
        else:
            self.model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        state = torch.load(path / "trainer_state.pt", weights_only=True)  # (never unpickles code: a shared run directory is not trusted)
        self.opt.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        return self.version
