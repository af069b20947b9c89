"""The GRPO objective's knobs (trainer.loss_agg, trainer.loss_norm_tokens, trainer.adv_scale) against numbers worked out
by hand, and the batch's gradient against micro-batching. Pure torch: a table model stands in for the LLM."""

import pytest
import torch

from rollart_dask.algo.advantages import advantage_fn, grpo_advantages
from rollart_dask.algo.losses import LOSSES, aggregation_weights, ppo_clip_loss
from rollart_dask.config import FlowError, TrainerConfig, load_flow
from rollart_dask.data.trainer_torch import TorchTrainer
from tests.conftest import flow_dict

CLIP = 0.2


def _example():
    """Three samples of 1, 2 and 3 response tokens, ratios chosen so that clipping is easy to follow by hand (clip 0.2):

    s0  A=2    r=1.1            → surrogate 2.2                        token losses  -2.2
    s1  A=-1   r=1.5, 0.9       → min(-1.5, -1.2) = -1.5; -0.9          token losses   1.5, 0.9
    s2  A=0.5  r=1.0, 1.4, 0.5  → 0.5; min(0.7, 0.6) = 0.6; min(0.25, 0.4) = 0.25   token losses  -0.5, -0.6, -0.25
    """
    ratios = [[1.1, 1.0, 1.0], [1.5, 0.9, 1.0], [1.0, 1.4, 0.5]]
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old = torch.full((3, 3), -1.0)
    logp = old + torch.log(torch.tensor(ratios))
    return logp, old, torch.tensor([2.0, -1.0, 0.5]), mask


# token losses sum: -2.2 + (1.5 + 0.9) + (-0.5 - 0.6 - 0.25) = -1.15 over 6 tokens and 3 samples
HAND = {
    "token_mean": -1.15 / 6,  # -0.191667
    "seq_mean": (-2.2 + 2.4 / 2 + -1.35 / 3) / 3,  # (-2.2 + 1.2 - 0.45) / 3 = -0.483333
    "constant": -1.15 / (3 * 4),  # loss_norm_tokens 4: -0.095833
}


def _batch_loss(agg, cuts, norm_tokens=4):
    """The trainer's accumulation (trainer_torch._update) on the example: each micro-batch's loss × its token share."""
    logp, old, adv, mask = _example()
    total = int(mask.sum())
    loss = 0.0
    for rows in cuts:
        m = mask[rows]
        w = aggregation_weights(m, agg, n_samples=3, total_tokens=total, norm_tokens=norm_tokens)
        part, _ = ppo_clip_loss(logp[rows], old[rows], adv[rows], m, clip=CLIP, token_weights=w)
        loss += part.item() * float(m.sum()) / total
    return loss


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("cuts", [[[0, 1, 2]], [[0], [1, 2]], [[0, 1], [2]], [[0], [1], [2]]], ids=["one", "1+2", "2+1", "1+1+1"])
def test_each_aggregation_gives_the_hand_computed_loss_whatever_the_cut(agg, cuts):
    assert _batch_loss(agg, cuts) == pytest.approx(HAND[agg], abs=1e-6)


def test_token_mean_weights_are_the_plain_token_mean():
    logp, old, adv, mask = _example()
    plain, _ = ppo_clip_loss(logp, old, adv, mask, clip=CLIP)
    assert plain.item() == pytest.approx(HAND["token_mean"], abs=1e-6)
    with pytest.raises(ValueError, match="token_mean, seq_mean, constant"):
        aggregation_weights(mask, "sum", 3, 6, 4)


class _Tokenizer:
    pad_token_id = 0


VOCAB = 6


class TableTrainer(TorchTrainer):
    """TorchTrainer's update (micro-batches, weights, accumulation) on a table model: a position's logits are a row of
    an embedding of its token. The optimizer step is left out: the tests read the accumulated gradient."""

    def __init__(self, model_dir="", *, clip=CLIP, entropy_coef=0.0, micro_batch_tokens=8192, loss="ppo_clip", **_):
        torch.manual_seed(0)
        self.model = torch.nn.Embedding(VOCAB, VOCAB)
        self.tokenizer = _Tokenizer()
        self.clip, self.entropy_coef, self.temperature, self.micro_batch_tokens = clip, entropy_coef, 1.0, micro_batch_tokens
        self.policy_loss = LOSSES.get(loss)
        self.version = 0

    def _vocab_size(self):
        return VOCAB

    def _logits(self, ids, attn):
        return self.model(ids)

    def _zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def _optimizer_step(self):
        return 0.0


def _prompt(n, start):
    return [1 + (start + i) % (VOCAB - 1) for i in range(n)]


SAMPLES = [  # responses of 1 to 4 tokens, padded widths 20, 25, 40, 45; behaviour log-probs off the model's
    {"prompt_ids": _prompt(19, 0), "response_ids": [3], "logprobs": [-1.5], "advantage": 1.2},
    {"prompt_ids": _prompt(23, 1), "response_ids": [5, 1], "logprobs": [-2.0, -1.0], "advantage": -0.7},
    {"prompt_ids": _prompt(37, 2), "response_ids": [1, 1, 2], "logprobs": [-1.9, -1.6, -1.7], "advantage": 0.4},
    {"prompt_ids": _prompt(41, 3), "response_ids": [2, 3, 4, 5], "logprobs": [-1.8, -2.1, -1.4, -1.6], "advantage": -0.9},
]
CUTS = {8192: 1, 100: 2, 64: 3}  # micro_batch_tokens → micro-batches: all; [20, 25] [40, 45]; [20, 25] [40] [45]


def _grad(micro_batch_tokens, **cfg):
    trainer = TableTrainer.from_config(TrainerConfig(micro_batch_tokens=micro_batch_tokens, **cfg), model_dir="")
    stats = trainer.train_step(SAMPLES)
    return trainer.model.weight.grad.clone(), stats, trainer


def _reference_loss(agg, entropy_coef, norm_tokens):
    """The objective written out sample by sample (trainer none-correction): Σ c_it · (-surrogate_it) - coef · token-mean entropy."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(VOCAB, VOCAB)
    n, total = len(SAMPLES), sum(len(s["response_ids"]) for s in SAMPLES)
    pg, ent = 0.0, 0.0
    for s in SAMPLES:
        seq = s["prompt_ids"] + s["response_ids"]
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        logp_all = torch.log_softmax(table(torch.tensor(seq[p - 1 : p - 1 + r])), -1)
        logp = logp_all.gather(-1, torch.tensor(s["response_ids"]).unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - torch.tensor(s["logprobs"]))
        a = s["advantage"]
        surr = torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
        c = {"token_mean": 1 / total, "seq_mean": 1 / (n * r), "constant": 1 / (n * norm_tokens)}[agg]
        pg = pg - c * surr.sum()
        ent = ent - (logp_all.exp() * logp_all).sum() / total
    return pg - entropy_coef * ent, table


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_the_gradient_of_micro_batches_is_the_gradient_of_one(agg, correction):
    # decoupled drops tokens (is_cap 1.1 here): their share counts in the policy term's denominators all the same; the
    # entropy bonus of a micro-batch is its kept tokens' mean, which is why it is left out there
    cfg = {
        "loss_agg": agg,
        "correction": correction,
        "entropy_coef": 0.0 if correction == "decoupled" else 0.05,
        "clip": CLIP,
        "is_cap": 1.1,
    }
    g_one, s_one, _ = _grad(8192, **cfg)
    assert s_one["forward_rows"] == 4 and g_one.abs().max() > 1e-3
    assert correction != "decoupled" or 0 < s_one["is_dropped"] < 1
    for mbt in (100, 64):
        g, s, _ = _grad(mbt, **cfg)
        assert torch.allclose(g, g_one, rtol=1e-5, atol=1e-7), (mbt, (g - g_one).abs().max())
        assert s["loss"] == pytest.approx(s_one["loss"], rel=1e-6) and s["pg_loss"] == pytest.approx(s_one["pg_loss"], rel=1e-6)
    if correction == "none":  # and both are the objective written out
        ref, table = _reference_loss(agg, 0.05, norm_tokens=4)  # None: the batch's longest response (4 tokens)
        ref.backward()
        assert torch.allclose(g_one, table.weight.grad, rtol=1e-5, atol=1e-7)
        assert s_one["loss"] == pytest.approx(ref.item(), abs=1e-6)


def test_the_micro_batches_of_the_gradient_test_really_cut():
    assert {mbt: len(TableTrainer(micro_batch_tokens=mbt).micro_batches(SAMPLES)) for mbt in CUTS} == CUTS


def test_constant_takes_loss_norm_tokens_and_the_aggregations_differ():
    g4, _, t = _grad(64, loss_agg="constant", loss_norm_tokens=4, entropy_coef=0.0)
    assert t.loss_norm_tokens == 4
    g8, _, _ = _grad(64, loss_agg="constant", loss_norm_tokens=8, entropy_coef=0.0)
    assert torch.allclose(g8 * 2, g4, rtol=1e-5, atol=1e-8)  # the policy term alone (entropy_coef 0): halves with a twice larger constant
    gt, _, _ = _grad(64, loss_agg="token_mean", entropy_coef=0.0)
    gs, _, _ = _grad(64, loss_agg="seq_mean", entropy_coef=0.0)
    assert not torch.allclose(gt, gs) and not torch.allclose(gt, g4)


# -- advantages: rewards [1, 0, 0, 0.5] → mean 0.375; deviations 0.625, -0.375, -0.375, 0.125;
# population variance (0.390625 + 0.140625 + 0.140625 + 0.015625) / 4 = 0.171875, std 0.4145781
def test_advantages_without_scaling_are_reward_minus_group_mean():
    assert grpo_advantages([1.0, 0.0, 0.0, 0.5], scale="none") == [0.625, -0.375, -0.375, 0.125]
    assert advantage_fn("grpo", "none")([3.0, 1.0]) == [1.0, -1.0]
    assert grpo_advantages([0.3, 0.3, 0.3], scale="none") == [0.0, 0.0, 0.0]


def test_advantages_scaled_by_the_group_std():
    std = 0.4145781
    want = [0.625 / std, -0.375 / std, -0.375 / std, 0.125 / std]  # 1.507557, -0.904534, -0.904534, 0.301511
    assert grpo_advantages([1.0, 0.0, 0.0, 0.5]) == pytest.approx(want, abs=1e-5)
    assert advantage_fn("grpo", "std")([3.0, 1.0]) == pytest.approx([1.0, -1.0], abs=1e-5)  # std 1
    with pytest.raises(ValueError, match="std, none"):
        grpo_advantages([1.0, 0.0], scale="batch")


# -- the flow keys
def test_defaults_are_todays_objective_and_constant_resolves_from_the_tasks():
    cfg = load_flow(data=flow_dict())
    assert (cfg.trainer.loss_agg, cfg.trainer.adv_scale, cfg.trainer.loss_norm_tokens) == ("token_mean", "std", None)
    tasks = [
        {"name": "a", "env": "frozenlake", "reward": "frozenlake", "max_tokens": 2},
        {"name": "b", "env": "frozenlake", "reward": "frozenlake", "max_tokens": 7},
    ]
    cfg = load_flow(data=flow_dict(**{"trainer.loss_agg": "constant", "tasks": tasks}))
    assert cfg.trainer.loss_norm_tokens == 7
    cfg = load_flow(data=flow_dict(**{"trainer.loss_agg": "constant", "trainer.loss_norm_tokens": 32}))
    assert cfg.trainer.loss_norm_tokens == 32


@pytest.mark.parametrize(
    "key,bad,allowed",
    [
        ("trainer.loss_agg", "seq_sum", ["'token_mean'", "'seq_mean'", "'constant'"]),
        ("trainer.adv_scale", "batch", ["'std'", "'none'"]),
    ],
)
def test_an_unknown_value_is_named_with_the_allowed_ones(key, bad, allowed):
    with pytest.raises(FlowError) as e:
        load_flow(data=flow_dict(**{key: bad}))
    msg = str(e.value)
    assert key in msg and all(a in msg for a in allowed), msg


def test_loss_norm_tokens_must_be_positive():
    with pytest.raises(FlowError, match="trainer.loss_norm_tokens"):
        load_flow(data=flow_dict(**{"trainer.loss_agg": "constant", "trainer.loss_norm_tokens": 0}))


def test_hand_numbers_of_the_example_are_what_the_docstring_says():
    """Guards the example itself: the ratios really are 1.1 / 1.5 … once exponentiated back."""
    logp, old, _, mask = _example()
    assert torch.allclose(torch.exp(logp - old)[mask], torch.tensor([1.1, 1.5, 0.9, 1.0, 1.4, 0.5]))
