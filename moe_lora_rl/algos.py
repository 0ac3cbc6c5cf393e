"""verl's RL algorithm pieces, reached from one place: GRPO outcome advantages, the registered policy losses,
loss aggregation and rollout correction (truncated importance sampling, or masked importance sampling: rejection).

    rewards -> grpo_advantages -> policy_loss(old, new, adv, mask, [tis_weights]) -> scalar for backward
    rollout correction: TIS rollout_correction -> tis_weights | MIS rollout_rejection -> mask (rejected tokens out)
    sparse rollouts (Sparse-RL): sparse_correction -> (mask with rejected sequences out, reweighting weights)

The policy losses read their settings from a verl ``ActorConfig``; ``actor_config`` builds the one they need from
our few settings, including ``global_batch_info`` so that token-mean normalises by the tokens of the whole global
batch (the same loss at every data-parallel size and microbatch split).

Every aggregation mode is a function of the global batch alone, never of how it is padded or split: token-mean
divides by the global batch's valid tokens, token-sum by nothing, the seq-mean-* modes by its sequences with a valid
token, and seq-mean-token-sum-norm (Dr. GRPO) also by ``loss_scale_factor``, a constant of the run (the main job: the
response budget, algo.max_response_tokens). verl's default for it (None: the tensor's width, the longest prompt +
response of the batch) moves with the padding, so PolicyLossSettings refuses that mode without the factor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

LOSS_MODES = ("vanilla", "gspo")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PolicyLossSettings:
    loss_mode: str = "vanilla"            # a verl registered policy loss: vanilla (PPO clip) or gspo
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0             # dual-clip bound for negative advantages (vanilla)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's constant divisor (verl's loss_scale_factor)

    def __post_init__(self):
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"loss_mode {self.loss_mode!r} is not one of {LOSS_MODES}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
        if not (0 < self.clip_ratio_low < 1 and self.clip_ratio_high > 0):
            raise ValueError(f"clip ratios low={self.clip_ratio_low} high={self.clip_ratio_high}: need 0<low<1, high>0")
        if self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1")
        if self.loss_scale_factor is not None and (isinstance(self.loss_scale_factor, bool) or
                                                   not isinstance(self.loss_scale_factor, int) or
                                                   self.loss_scale_factor < 1):
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor!r} must be None or an integer >= 1")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor (a constant of the run, "
                             "the response budget): without it verl divides by the padded width of each batch")


@dataclass(frozen=True)
class GlobalBatch:
    """What the whole optimizer step sees, so each microbatch's loss is its share of the global loss."""
    dp_size: int = 1
    batch_num_tokens: int | None = None   # valid response tokens in the global batch (token-mean)
    global_batch_size: int | None = None  # sequences in the global batch (seq-mean-*)
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm horizon

    def as_kwargs(self) -> dict:
        return dict(dp_size=self.dp_size, batch_num_tokens=self.batch_num_tokens,
                    global_batch_size=self.global_batch_size, loss_scale_factor=self.loss_scale_factor)


def grpo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence,
                    *, norm_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    """Per-token GRPO advantages [B, T] from one scalar reward per response [B] and the prompt id of each response.

    verl takes token-level rewards; an outcome reward sits on the response's last valid token (verl's convention,
    only its sum is used). A group of two or more equal rewards gets advantages of exactly 0 (grpo_outcome_advantage)."""
    if rewards.dim() != 1 or response_mask.dim() != 2 or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be [B] and response_mask {tuple(response_mask.shape)} "
                         "[B, T] with the same B")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"{len(group_ids)} group ids for {rewards.shape[0]} responses")
    lengths = response_mask.sum(-1).long()
    if (lengths == 0).any():
        raise ValueError(f"responses {torch.nonzero(lengths == 0).flatten().tolist()} have no valid token")
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards.float()
    adv, _ = grpo_outcome_advantage(token_rewards, response_mask.float(), np.asarray(group_ids, dtype=object),
                                    epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std)
    return adv


GRPO_EXACT = "grpo_exact"                 # the name grpo_outcome_advantage is registered under in verl


def grpo_outcome_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
                           epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True, config=None,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage (compute_grpo_outcome_advantage, same signature: verl's advantage-estimator
    registry calls it as GRPO_EXACT, reading norm_adv_by_std_in_grpo from `config`, verl's algorithm section) with
    one fix: a group of two or more responses whose rewards are all equal
    gets advantages of exactly 0. verl subtracts the group's fp32 mean, which for equal non-dyadic rewards differs
    from them by a rounding step, and divides that residue by a std of ~1e-7 plus epsilon: eight rewards of 0.35
    gave +0.0289 each. Other groups, and a group of one (verl's convention: mean 0, std 1), are verl's own numbers.
    Returns (advantages, returns) [B, T], both the same tensor, as verl's."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    if config is not None:                    # verl's trainer passes algorithm.* here, not the keyword
        norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    scores = token_level_rewards.sum(dim=-1)
    adv, ret = compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=epsilon,
                                              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
    groups: dict = {}
    for i, g in enumerate(index.tolist() if hasattr(index, "tolist") else list(index)):
        groups.setdefault(g, []).append(i)
    flat = [rows for rows in groups.values() if len(rows) > 1 and bool((scores[rows] == scores[rows[0]]).all())]
    if flat:
        rows = torch.tensor([i for r in flat for i in r])
        adv = adv.clone()
        adv[rows] = 0.0
        ret = adv
    return adv, ret


def actor_config(settings: PolicyLossSettings, batch: GlobalBatch = GlobalBatch(), rollout_n: int = 1):
    """The verl ActorConfig the registered policy losses read (clip ratios, aggregation, global batch info)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return ActorConfig(strategy="megatron", rollout_n=rollout_n, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=settings.clip_ratio_low, clip_ratio_low=settings.clip_ratio_low,
                       clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
                       loss_agg_mode=settings.loss_agg_mode, policy_loss=PolicyLossConfig(loss_mode=settings.loss_mode),
                       global_batch_info=batch.as_kwargs())


def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, settings: PolicyLossSettings, batch: GlobalBatch = GlobalBatch(),
                rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """verl's registered policy loss ``settings.loss_mode`` on one microbatch: (scalar loss, metrics)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    shapes = {t.shape for t in (old_log_prob, log_prob, advantages, response_mask)}
    if len(shapes) != 1:
        raise ValueError(f"policy loss inputs disagree in shape: {sorted(map(tuple, shapes))}")
    fn = get_policy_loss_fn(settings.loss_mode)
    return fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
              response_mask=response_mask.to(log_prob.dtype), loss_agg_mode=settings.loss_agg_mode,
              config=actor_config(settings, batch), rollout_is_weights=rollout_is_weights)


def aggregate(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
              batch: GlobalBatch = GlobalBatch()) -> torch.Tensor:
    """verl's agg_loss (e.g. for a KL-to-reference term aggregated like the policy loss)."""
    from verl.trainer.ppo.core_algos import agg_loss

    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
    return agg_loss(loss_mat=loss_mat, loss_mask=loss_mask.to(loss_mat.dtype), loss_agg_mode=loss_agg_mode,
                    **batch.as_kwargs())


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """verl's per-token KL estimate to the reference policy (k1 'kl', k2 'mse', k3 'low_var_kl')."""
    from verl.trainer.ppo.core_algos import kl_penalty as _kl

    return _kl(log_prob, ref_log_prob, kind)


def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       *, level: str = "token", threshold: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Truncated importance-sampling weights min(pi_train / pi_rollout, threshold) per token ('token') or per
    sequence ('sequence'), zero on padding, detached; plus verl's mismatch metrics (prefixed rollout_corr/)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout correction level {level!r} is not one of {ROLLOUT_IS_LEVELS}")
    if not threshold > 1:
        raise ValueError(f"rollout correction threshold={threshold} must be > 1")
    weights, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask.float(),
        rollout_is=level, rollout_is_threshold=threshold)
    return weights.batch["rollout_is_weights"], metrics


def rollout_rejection(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                      *, threshold: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Masked importance sampling (verl's token-level rejection sampling, rollout_rs="token_k1"): the response mask
    with every token whose ratio pi_train / pi_rollout = exp(old - rollout) lies outside [1/threshold, threshold]
    (bounds included in the kept range) set to False, in response_mask's dtype; kept tokens are not reweighted.
    Padding stays out whatever its logprobs. Plus verl's rejection and mismatch metrics (prefixed rollout_corr/,
    e.g. rollout_corr/rollout_rs_masked_fraction: the rejected share of the valid tokens).

    The caller replaces its loss mask with the result, as verl's trainer replaces response_mask, so rejected tokens
    leave the token-mean normaliser too."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if not threshold > 1:
        raise ValueError(f"rollout rejection threshold={threshold} must be > 1")
    # verl's k1 statistic is -log ratio, kept within [log lower, log upper]: a symmetric pair is the ratio band
    bounds = f"{1.0 / float(threshold)!r}_{float(threshold)!r}"
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask.float(),
        rollout_is=None, rollout_rs="token_k1", rollout_rs_threshold=bounds)
    return (kept > 0).to(response_mask.dtype), metrics


@dataclass(frozen=True)
class SparseCorrection:
    """Sparse-RL's corrections for rollouts sampled on a compressed KV cache (arXiv 2601.10079; defaults from its
    public training config, examples/train_infer_mismatch_helper/mis.yaml): per token the consistency ratio
    rho = pi_dense / pi_sparse = exp(dense recompute - sampler logprob); a sequence with any rho < veto is rejected
    whole; tokens with rho outside [lower, upper] leave the loss; the kept tokens are weighted by min(rho, upper),
    normalised to mean 1 over the kept tokens of the batch (batch_normalize)."""
    veto: float = 1e-4
    lower: float = 0.5
    upper: float = 1.5
    batch_normalize: bool = True

    def __post_init__(self):
        if not 0 <= self.veto < 1:
            raise ValueError(f"sparse correction veto={self.veto} must be in [0, 1)")
        if not 0 <= self.lower < 1 < self.upper:
            raise ValueError(f"sparse correction band lower={self.lower}, upper={self.upper}: need 0 <= lower < 1 "
                             "< upper")


def sparse_correction(dense_log_prob: torch.Tensor, sparse_log_prob: torch.Tensor, response_mask: torch.Tensor,
                      settings: SparseCorrection = SparseCorrection()) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(kept mask in response_mask's dtype, weights [B, T] float32 (0 off the kept tokens), metrics).

    metrics: sparse/seq_rejected_frac (the sequences vetoed, of those with a valid token), sparse/token_masked_frac
    (valid tokens out of the loss: vetoed sequences and out-of-band tokens), sparse/ratio_{min,mean,max} and
    sparse/log_ratio_abs_mean over the valid tokens, sparse/weight_norm_factor (the kept weights' mean before
    normalising)."""
    shapes = {tuple(t.shape) for t in (dense_log_prob, sparse_log_prob, response_mask)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"sparse correction inputs must share one [B, T] shape, got {sorted(shapes)}")
    valid = response_mask.bool()
    log_ratio = (dense_log_prob.double() - sparse_log_prob.double()).clamp(-20.0, 20.0)
    rho = torch.exp(log_ratio)
    vetoed = ((rho < settings.veto) & valid).any(-1)                      # [B]
    kept = valid & ~vetoed[:, None] & (rho >= settings.lower) & (rho <= settings.upper)
    w = torch.where(kept, rho.clamp(max=settings.upper), torch.zeros((), dtype=rho.dtype))
    norm = float(w.sum() / kept.sum()) if kept.any() else 1.0
    if settings.batch_normalize and kept.any():
        w = w / norm
    rows = valid.any(-1)
    n_valid = max(int(valid.sum()), 1)
    v = rho[valid]
    metrics = {"sparse/seq_rejected_frac": float(vetoed[rows].float().mean()) if rows.any() else 0.0,
               "sparse/token_masked_frac": 1.0 - int(kept.sum()) / n_valid,
               "sparse/ratio_min": float(v.min()) if v.numel() else 1.0,
               "sparse/ratio_mean": float(v.mean()) if v.numel() else 1.0,
               "sparse/ratio_max": float(v.max()) if v.numel() else 1.0,
               "sparse/log_ratio_abs_mean": float(log_ratio[valid].abs().mean()) if v.numel() else 0.0,
               "sparse/weight_norm_factor": norm}
    return kept.to(response_mask.dtype), w.float(), metrics
