"""The policy loss, token by token, read top to bottom.

Notation, per token t of a generated response (all tensors (B, T), the mask m_t = 1 on generated tokens):

    logp_t      log pi_theta(y_t | y_<t) of the model being trained, at the sampling temperature
    old_t       the same under the weights before this update (no gradient); with one update per batch it is
                logp_t detached, so the ratio is 1 and its gradient is the policy gradient
    rollout_t   the log-prob the serving engine reported when it sampled y_t (the trajectory's ``logprobs``)
    A           the episode's advantage (trainer/algorithm/advantages.py), the same for every token of the episode

    ratio_t     = exp(clamp(logp_t - old_t, -20, 20))
    pg_t        = max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))     PPO-clip, DAPO's two ranges
    pg_t        = min(pg_t, c * |A|)   where A < 0, with dual-clip c > 1 (Ye et al. 2020; c = 0: off)
    w_t         = min(exp(clamp(old_t - rollout_t, -20, 20)), C)                     truncated IS (TIS), no gradient
    kl_t        = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                         k3 estimator of KL(pi || ref)
    loss        = sum_t m_t * (w_t * pg_t + beta * kl_t) / sum_t m_t                 token mean over the whole batch

The TIS weight corrects for the difference between the engine that sampled and the trainer's numerics (and any
staleness): it is verl's ``compute_policy_loss_vanilla`` correction (``tis_imp_ratio = exp(old_log_prob -
rollout_log_probs)``, clamped above at ``tis_imp_ratio_cap``, multiplied into the per-token PPO loss) and slime's
``compute_tis_weights`` (the same ratio clamped to ``[tis_clip_low, tis_clip]``, low bound 0 by default). The k3 KL
is verl's ``low_var_kl`` (log-ratio clamped to +-20, the estimate to +-10). Entropy (of the temperature-scaled
distribution) and the clip fraction (tokens whose clipped term is the larger, as verl counts it) are metrics only.

Why the clamps: with ``mini_batches > 1`` a later mini-batch's log-ratio can grow without bound (exp overflows
float32 above ~88.7, and an infinite ratio times a zero advantage is NaN); +-20 (ratio up to ~5e8) is far beyond any
update worth taking and keeps every term finite. Dual-clip bounds the other unclipped side: for a negative advantage
PPO-clip takes ``-A * ratio`` however large the ratio, so one token the old policy found unlikely can dominate the
batch; dual-clip caps that token's loss at ``c * |A|`` (no gradient past the cap), as verl's ``clip_ratio_c``.
The ratio and TIS-weight minima and maxima are reported with the sums (``ratio_min`` ...: reduced by min / max).

Token mean: the denominator is the number of loss tokens of the whole (mini-)batch over every micro-batch and every
data-parallel rank, so that splitting a batch never changes the loss or its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's knobs (defaults: DAPO's clip ranges, TIS cap 2 as slime's default, no KL)."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    tis_cap: float | None = 2.0     # None: no truncated importance sampling
    kl_coef: float = 0.0            # beta; > 0 needs a frozen reference model
    temperature: float = 1.0        # the rollout's sampling temperature (<= 0: greedy, the plain distribution)
    dual_clip: float = 0.0          # c > 1: a negative advantage's token loss is capped at c * |A| (0: off)
    max_log_ratio: float = 20.0     # log-ratios are clamped to +-this before exp (keeps every term finite)

    def __post_init__(self) -> None:
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or 0: off), not {self.dual_clip}")
        if self.max_log_ratio <= 0:
            raise ValueError("max_log_ratio must be > 0")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target (B, T) and the entropy of each position's distribution, computed exactly as the
    serving engine scores a sampled token (``policy.engine.sample``): ``log_softmax(logits / temperature)`` in
    float32 (or wider), the plain distribution when greedy."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    logp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(-1)
    return logp, entropy


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum of x where mask is set (whatever x holds elsewhere: padding never leaks in, not even a NaN)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def token_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum(x * mask) / denom; ``denom`` defaults to this mask's token count (the batch-wide count in training)."""
    if denom is None:
        denom = mask.sum().clamp_min(1.0)
    return masked_sum(x, mask) / denom


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Masked NLL: the token mean of -log p over the mask (``denom``: the batch's token count)."""
    return -token_mean(logp, mask, denom)


def safe_ratio(logp: torch.Tensor, base: torch.Tensor, max_log_ratio: float = 20.0) -> torch.Tensor:
    """exp(logp - base) with the log-ratio clamped to +-``max_log_ratio`` first (finite whatever the inputs)."""
    return torch.exp(torch.clamp(logp - base, -max_log_ratio, max_log_ratio))


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
             dual_clip: float = 0.0, max_log_ratio: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with separate low / high ranges (and dual-clip for negative advantages when
    ``dual_clip`` > 1), and where a clipped term was taken."""
    ratio = safe_ratio(logp, old_logp, max_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(unclipped, clipped)
    taken = clipped > unclipped
    if dual_clip:
        cap = -advantages * dual_clip          # c * |A| where A < 0
        capped = (advantages < 0) & (pg > cap)
        pg = torch.where(capped, cap, pg)
        taken = taken | capped
    return pg, taken


def tis_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float, max_log_ratio: float = 20.0
               ) -> torch.Tensor:
    """Truncated importance weight min(pi_train_old / pi_rollout, C); data, never differentiated."""
    return safe_ratio(old_logp.detach(), rollout_logp.detach(), max_log_ratio).clamp(max=cap)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token (non-negative, low variance)."""
    d = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: LossConfig, denom: float | torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (a scalar, token mean with ``denom``) and this micro-batch's metric sums over its loss tokens
    (divide by ``tokens`` after summing over micro-batches and ranks)."""
    pg, clipped = ppo_clip(logp, old_logp, advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.max_log_ratio)
    per_token = pg
    w = None
    if cfg.tis_cap is not None:
        w = tis_weight(old_logp, rollout_logp, cfg.tis_cap, cfg.max_log_ratio)
        per_token = per_token * w
    kl = None
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp)
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    loss = token_mean(per_token, mask, denom)

    with torch.no_grad():
        m = mask.float()
        log_raw = torch.clamp(old_logp - rollout_logp, -cfg.max_log_ratio, cfg.max_log_ratio)
        raw = torch.exp(log_raw)                    # pi_train_old / pi_rollout, before truncation
        ratio = safe_ratio(logp, old_logp, cfg.max_log_ratio)
        sel = mask.bool()
        sums = {
            "tokens": float(m.sum()),
            "pg_loss": float(masked_sum(pg, m)),
            "clip_frac": float(masked_sum(clipped.float(), m)),
            "ratio": float(masked_sum(ratio, m)),
            "dual_clip_frac": float(masked_sum(((advantages < 0) & (pg >= -advantages * cfg.dual_clip)).float(), m))
            if cfg.dual_clip else 0.0,
            "tis_weight": float(masked_sum(w, m)) if w is not None else float(m.sum()),
            "tis_clip_frac": float(masked_sum((raw > cfg.tis_cap).float(), m)) if cfg.tis_cap is not None else 0.0,
            "rollout_kl": float(masked_sum(raw - log_raw - 1.0, m)),         # k3 of KL(pi_rollout || pi_train)
            "rollout_logprob_abs_diff": float(masked_sum(log_raw.abs(), m)),
        }
        if bool(sel.any()):   # extremes over this micro-batch's loss tokens (merged by min / max, not summed)
            sums["ratio_min"], sums["ratio_max"] = float(ratio[sel].min()), float(ratio[sel].max())
            tis = w if w is not None else raw
            sums["tis_weight_min"], sums["tis_weight_max"] = float(tis[sel].min()), float(tis[sel].max())
        if kl is not None:
            sums["kl_ref"] = float(masked_sum(kl, m))
        if entropy is not None:
            sums["entropy"] = float(masked_sum(entropy, m))
    return loss, sums
