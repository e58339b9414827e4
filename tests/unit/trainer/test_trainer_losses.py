"""The loss formulas against hand-computed values, and their gradients: zero on masked tokens and on clipped ratios,
the TIS weight and the clipped-out branch carry none, the unclipped gradient is -A * ratio * w / tokens."""

import math

import pytest
import torch

from trainer.algorithm.losses import (
    LossConfig,
    kl_k3,
    policy_loss,
    ppo_clip,
    sft_loss,
    tis_weight,
    token_logprobs,
    token_mean,
)

T = torch.tensor


def test_token_logprobs_match_the_engines_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs(logits, targets, temp)
        ref = torch.log_softmax(logits / temp, -1)
        assert torch.allclose(lp, ref.gather(-1, targets[..., None])[..., 0])
        assert torch.allclose(ent, -(ref.exp() * ref).sum(-1))
    # greedy (temperature 0): the plain distribution, as policy.engine.sample reports it
    lp0, _ = token_logprobs(logits, targets, 0.0)
    assert torch.allclose(lp0, torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0])
    # a uniform distribution over 7: log(1/7), entropy log 7
    lp, ent = token_logprobs(torch.zeros(1, 1, 7), torch.zeros(1, 1, dtype=torch.long))
    assert lp.item() == pytest.approx(-math.log(7)) and ent.item() == pytest.approx(math.log(7))


def test_ppo_clip_by_hand():
    logp = torch.log(T([1.5, 1.5, 0.5, 0.5, 1.1]))
    old = torch.zeros(5)
    adv = T([1.0, -1.0, 1.0, -1.0, 2.0])
    loss, clipped = ppo_clip(logp, old, adv, eps_low=0.2, eps_high=0.28)
    # ratio 1.5, A>0: max(-1.5, -1.28) = -1.28 (clipped); A<0: max(1.5, 1.28) = 1.5 (not clipped)
    # ratio 0.5, A>0: max(-0.5, -0.8) = -0.5 (not); A<0: max(0.5, 0.8) = 0.8 (clipped); ratio 1.1, A=2: -2.2
    assert loss.tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8, -2.2])
    assert clipped.tolist() == [True, False, False, True, False]


def test_token_mean_uses_the_given_denominator():
    x, m = T([1.0, 2.0, 3.0, 4.0]), T([1.0, 0.0, 1.0, 1.0])
    assert token_mean(x, m).item() == pytest.approx(8 / 3)
    assert token_mean(x, m, 16.0).item() == pytest.approx(0.5)
    # masked positions never leak in, whatever they hold
    assert token_mean(T([1.0, float("nan"), 3.0, float("inf")]), T([1.0, 0.0, 1.0, 0.0])).item() == pytest.approx(2.0)


def test_tis_weight_is_truncated_and_carries_no_gradient():
    old = torch.log(T([3.0, 0.5, 2.0])).requires_grad_()
    w = tis_weight(old, torch.zeros(3), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, 0.5, 2.0])
    assert not w.requires_grad


def test_kl_k3_by_hand():
    logp = torch.zeros(3)
    ref = torch.log(T([2.0, 1.0, 0.5]))
    # exp(d) - d - 1 with d = ref - logp
    assert kl_k3(logp, ref).tolist() == pytest.approx([1 - math.log(2), 0.0, -0.5 + math.log(2)])
    assert (kl_k3(torch.randn(50), torch.randn(50)) >= 0).all()


def test_policy_loss_by_hand():
    # one sequence of 4 positions, 3 on the mask; ratio 1 (old = logp), TIS weights 2 (capped), 1, 0.5; A = 0.5
    logp = torch.log(T([[0.5, 0.25, 0.8, 0.1]]))
    rollout = torch.log(T([[0.1, 0.25, 1.6, 0.1]]))
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.full((1, 4), 0.5)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=2.0)
    loss, s = policy_loss(logp, logp.detach(), rollout, adv, mask, cfg)
    # per token -A * w: -1.0, -0.5, -0.25 -> mean over 3 tokens
    assert loss.item() == pytest.approx(-1.75 / 3)
    assert s["tokens"] == 3 and s["tis_weight"] == pytest.approx(3.5) and s["tis_clip_frac"] == 1
    assert s["clip_frac"] == 0 and s["ratio"] == pytest.approx(3.0)
    assert s["rollout_logprob_abs_diff"] == pytest.approx(math.log(5) + 0 + math.log(2))
    # rollout_kl: k3 of KL(rollout || train) = r - 1 - log r with r = pi_train / pi_rollout
    assert s["rollout_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in (5.0, 1.0, 0.5)))
    # without TIS, with a KL term to a reference 2x as likely on every token
    cfg2 = LossConfig(tis_cap=None, kl_coef=0.1)
    ref = logp + math.log(2)
    loss2, s2 = policy_loss(logp, logp.detach(), rollout, adv, mask, cfg2, denom=6.0, ref_logp=ref)
    kl = 2 - math.log(2) - 1
    assert loss2.item() == pytest.approx((3 * -0.5 + 3 * 0.1 * kl) / 6)
    assert s2["kl_ref"] == pytest.approx(3 * kl)


def _grad(logp_values, old_values, adv_values, mask_values, cfg, rollout=None, ref=None):
    logp = torch.tensor(logp_values, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old_values, dtype=torch.float64)
    rollout_t = old.clone() if rollout is None else torch.tensor(rollout, dtype=torch.float64)
    ref_t = None if ref is None else torch.tensor(ref, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, rollout_t, torch.tensor(adv_values, dtype=torch.float64),
                          torch.tensor(mask_values, dtype=torch.float64), cfg, ref_logp=ref_t)
    loss.backward()
    assert logp.grad is not None
    return logp.grad


def test_gradient_is_zero_on_masked_tokens():
    cfg = LossConfig(tis_cap=2.0, kl_coef=0.5)
    g = _grad([-1.0, -2.0, -0.5, -3.0], [-1.1, -2.0, -0.7, -2.0], [1.0, -1.0, 2.0, 1.0], [1.0, 0.0, 1.0, 0.0], cfg,
              rollout=[-1.0, -1.5, -0.6, -2.5], ref=[-1.2, -1.0, -0.4, -5.0])
    assert g[1] == 0 and g[3] == 0
    assert g[0] != 0 and g[2] != 0


def test_gradient_is_zero_where_the_ratio_is_clipped():
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=None)
    up, down, inside = math.log(1.5), math.log(0.5), math.log(1.1)
    # A>0 and ratio above 1+eps_high, A<0 and ratio below 1-eps_low: clipped, no gradient
    g = _grad([up, down, inside, inside, up, down], [0.0] * 6, [1.0, -1.0, 1.0, -1.0, -1.0, 1.0], [1.0] * 6, cfg)
    assert g[0] == 0 and g[1] == 0
    # inside the range, and the unclipped sides (A<0 above, A>0 below): d loss / d logp = -A * ratio / tokens
    assert g[2].item() == pytest.approx(-1.0 * 1.1 / 6)
    assert g[3].item() == pytest.approx(1.0 * 1.1 / 6)
    assert g[4].item() == pytest.approx(1.0 * 1.5 / 6)
    assert g[5].item() == pytest.approx(-1.0 * 0.5 / 6)


def test_tis_scales_the_gradient_but_is_not_differentiated():
    cfg = LossConfig(tis_cap=2.0)
    # old - rollout = log 3 -> w = 2 (capped); log 0.5 -> w = 0.5; ratio 1 (logp = old)
    g = _grad([-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [1.0, 1.0], cfg, rollout=[-1.0 - math.log(3), -1.0 + math.log(2)])
    assert g.tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])


def test_sft_loss_is_the_masked_token_mean_nll_and_ignores_the_rest():
    logp = torch.log(T([[0.5, 0.25, 0.1], [0.9, 0.2, 0.3]])).requires_grad_()
    mask = T([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    loss = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25) + math.log(0.2)) / 3)
    loss.backward()
    assert logp.grad is not None
    assert (logp.grad[mask == 0] == 0).all() and torch.allclose(logp.grad[mask == 1], torch.full((3,), -1 / 3))


def test_a_huge_log_ratio_keeps_the_loss_and_its_gradient_finite():
    """A later mini-batch can move a token's log-prob far from the old one: exp(100) is inf in float32, and inf
    times a zero advantage (or a masked token) is NaN. The log-ratio is clamped to +-20 before exp."""
    logp = T([[100.0, -100.0, 0.0]], requires_grad=True)
    old = T([[0.0, 0.0, 0.0]])
    rollout = T([[0.0, 150.0, 0.0]])
    adv = T([[0.0, 1.0, -1.0]])
    mask = T([[1.0, 1.0, 1.0]])
    for cfg in (LossConfig(), LossConfig(tis_cap=None), LossConfig(dual_clip=3.0)):
        loss, sums = policy_loss(logp, old, rollout, adv, mask, cfg)
        assert math.isfinite(float(loss.detach())), cfg
        loss.backward()
        assert logp.grad is not None and torch.isfinite(logp.grad).all()
        logp.grad = None
        assert all(math.isfinite(v) for v in sums.values()), sums
        assert sums["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
        assert sums["ratio_min"] == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_dual_clip_caps_a_negative_advantage_tokens_loss():
    """Dual-clip (Ye et al. 2020): with A < 0 and a ratio beyond c, the token's loss is c * |A| and carries no
    gradient; positive advantages and ratios below c are untouched; 0 turns it off."""
    logp = torch.log(T([[5.0, 2.0, 5.0]])).requires_grad_(True)
    old = T([[0.0, 0.0, 0.0]])
    adv = T([[-2.0, -2.0, 1.0]])
    pg_off, _ = ppo_clip(logp, old, adv, 0.2, 0.28)
    assert pg_off.tolist()[0] == pytest.approx([10.0, 4.0, -1.28])      # -A * r for A < 0, unbounded
    pg, taken = ppo_clip(logp, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert pg.tolist()[0] == pytest.approx([6.0, 4.0, -1.28])           # capped at 3 * |A|
    assert taken.tolist() == [[True, False, True]]
    pg.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(4.0)
    loss, sums = policy_loss(logp.detach(), old, old, adv, T([[1.0, 1.0, 1.0]]), LossConfig(dual_clip=3.0))
    assert sums["dual_clip_frac"] == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)


def test_ratio_and_tis_extremes_are_reported_over_loss_tokens_only():
    logp = T([[-1.0, -2.0, -3.0]])
    old = T([[-1.5, -2.0, 5.0]])          # the last token is masked out: its ratio exp(-8) must not show
    rollout = T([[-1.0, -1.0, -1.0]])
    _, sums = policy_loss(logp, old, rollout, T([[1.0, 1.0, 1.0]]), T([[1.0, 1.0, 0.0]]), LossConfig(tis_cap=2.0))
    assert sums["ratio_min"] == pytest.approx(1.0) and sums["ratio_max"] == pytest.approx(math.exp(0.5))
    assert sums["tis_weight_min"] == pytest.approx(math.exp(-1.0)) and sums["tis_weight_max"] == pytest.approx(
        math.exp(-0.5))
