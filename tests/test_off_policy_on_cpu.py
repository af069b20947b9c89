"""Off-policy corrections (trainer.correction; algo/losses.off_policy) on tensors whose answer is known, and through the
real trainer: IS weights are 1 on on-policy data, truncated (tis) or dropped (decoupled) past the cap off it."""

import math

import pytest
import torch

from rollart_dask.algo.losses import off_policy, ppo_clip_loss


def _batch():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, mask, torch.tensor([1.0, -0.5])


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_on_policy_data_has_weight_one_and_the_gradient_of_no_correction(correction):
    logp, mask, adv = _batch()
    old, w, kept, stats = off_policy(correction, logp, logp.detach().clone(), mask, cap=2.0)
    assert torch.equal(w, mask.float()) and torch.equal(kept, mask)
    assert (
        stats["is_weight_mean"] == 1.0
        and stats["is_weight_p99"] == 1.0
        and max(stats.get("is_truncated", 0), stats.get("is_dropped", 0)) == 0
    )
    loss, _ = ppo_clip_loss(logp, old, adv, kept, clip=0.2, is_weights=w)
    (g,) = torch.autograd.grad(loss, logp)
    logp2, _, _ = _batch()
    base, _ = ppo_clip_loss(logp2, logp2.detach().clone(), adv, mask, clip=0.2)  # none: behaviour = this policy
    (g0,) = torch.autograd.grad(base, logp2)
    assert torch.allclose(g, g0)


def test_off_policy_weights_are_truncated_by_tis_and_dropped_by_decoupled():
    logp, mask, adv = _batch()
    behaviour = logp.detach() - torch.tensor([[0.0, math.log(3.0), math.log(1.5)], [0.0, 0.0, 5.0]])  # w = 1, 3, 1.5 / 1, 1, (pad)
    _, w, kept, stats = off_policy("tis", logp, behaviour, mask, cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 1.5], [1.0, 1.0, 0.0]]))  # 3 truncated to the cap; the pad stays 0
    assert stats["is_truncated"] == pytest.approx(1 / 5) and stats["is_weight_mean"] == pytest.approx((1 + 3 + 1.5 + 1 + 1) / 5)
    _, w, kept, stats = off_policy("decoupled", logp, behaviour, mask, cap=2.0)
    assert kept.tolist() == [[True, False, True], [True, True, False]] and w[0, 1] == 0 and stats["is_dropped"] == pytest.approx(1 / 5)
    _, w, _, _ = off_policy("tis", logp, behaviour, mask, cap=4.0, level="sequence")  # one weight per sample: 1·3·1.5 = 4.5 → 4
    assert torch.allclose(w[0], torch.full((3,), 4.0)) and torch.allclose(w[1, :2], torch.ones(2))
    with pytest.raises(ValueError, match="not one of none, tis, decoupled"):
        off_policy("vtrace", logp, behaviour, mask, cap=2.0)


def test_the_trainer_reports_the_weights_of_its_correction(model_dir):
    """Through the real torch engine and trainer (same weights): samples with the engine's own log-probs — on-policy —
    give IS weights of 1 and nothing truncated."""
    from rollart_dask.config import TrainerConfig
    from rollart_dask.data.engine_torch import TorchEngine
    from rollart_dask.data.trainer_torch import TorchTrainer

    engine = TorchEngine(str(model_dir), seed=0)
    [c] = engine.generate([{"id": "r", "prompt": "abc", "choices": None, "max_tokens": 6, "temperature": 1.0}])
    sample = {"prompt_ids": c.prompt_ids, "response_ids": c.token_ids, "logprobs": c.logprobs, "advantage": 1.0}
    trainer = TorchTrainer.from_config(TrainerConfig(correction="tis", is_cap=2.0, lr=1e-3), model_dir=str(model_dir))
    stats = trainer.train_step([sample, dict(sample, advantage=-1.0)])
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and stats["is_truncated"] == 0
