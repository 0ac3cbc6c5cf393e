"""verl's Megatron learning-rate schedule on our engine's AdamW: the scheduler is verl's own
(verl.utils.megatron.optimizer.get_megatron_optimizer_param_scheduler: megatron-core's OptimizerParamScheduler built
from actor.optim), driven as verl's Megatron engine drives it (step(0) at construction sets the first lr, one
step(1) per lr_scheduler_step, which verl's TrainingWorker calls after the last mini-batch of each update), on the
param_groups of our torch AdamW (it sets each group's lr and weight_decay).

    check_lr_schedule(optim)          one-line ValueError for a setting megatron-core's scheduler cannot run; no
                                      total step count needed (verl's trainer sets total_training_steps later)
    build_lr_scheduler(opt, optim)    verl's scheduler on our AdamW whenever the config has the Megatron keys and a
                                      step count (verl's trainer sets total_training_steps); None only without
                                      them and with no schedule asked (a constant lr)

verl's config with no Megatron schedule keys (its base OptimizerConfig) runs at a constant lr; a warmup asked of it
is refused (those keys are read by verl's Megatron schedule only).
"""
from __future__ import annotations

OPTIM = "actor_rollout_ref.actor.optim"
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")     # OptimizerParamScheduler.get_lr
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


def _get(cfg, key, default=None):
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _has_megatron_keys(optim) -> bool:
    return _get(optim, "lr_decay_style") is not None


def warmup_steps(optim, decay_steps: int) -> int:
    """verl's rule: lr_warmup_steps when > 0, else int(lr_warmup_steps_ratio * decay_steps)."""
    steps, ratio = _get(optim, "lr_warmup_steps"), _get(optim, "lr_warmup_steps_ratio")
    if ratio is not None and (steps is None or steps <= 0):
        return int(ratio * decay_steps)
    return int(steps or 0)


def decay_steps(optim) -> int:
    """lr_decay_steps, or total_training_steps when it is null (verl's rule; <= 0: not known yet)."""
    d = _get(optim, "lr_decay_steps")
    return int(_get(optim, "total_training_steps", -1) if d is None else d)


def _asks_schedule(optim) -> bool:
    steps, ratio = _get(optim, "lr_warmup_steps") or 0, _get(optim, "lr_warmup_steps_ratio") or 0.0
    return (_get(optim, "lr_decay_style", "constant") != "constant" or steps > 0 or ratio > 0
            or _get(optim, "weight_decay_incr_style", "constant") != "constant")


def check_lr_schedule(optim) -> None:
    """ValueError naming the key for: lr_decay_style not one of megatron-core's (DECAY_STYLES; verl's comment
    spells inverse_square_root, megatron-core reads inverse-square-root), WSD without lr_wsd_decay_steps or with
    an lr_wsd_decay_style megatron-core lacks, weight_decay_incr_style not in WD_STYLES, min_lr < 0, min_lr or
    lr_warmup_init above lr, a warmup ratio outside [0, 1), lr_decay_steps <= 0 or not above lr_warmup_steps, and a
    warmup or decay asked of a config without verl's Megatron schedule keys."""
    if optim is None:
        return
    lr = float(_get(optim, "lr"))
    if not _has_megatron_keys(optim):
        if _asks_schedule(optim) or (_get(optim, "lr_scheduler_type") or "constant") != "constant":
            raise ValueError(f"{OPTIM}: a warmup or lr schedule needs verl's Megatron optimizer config "
                             "(optim=megatron: lr_decay_style, lr_warmup_steps, min_lr, ...); this one has none")
        return
    style = _get(optim, "lr_decay_style")
    if style not in DECAY_STYLES:
        hint = " (megatron-core spells it inverse-square-root)" if style == "inverse_square_root" else ""
        raise ValueError(f"{OPTIM}.lr_decay_style={style!r}: choose one of {DECAY_STYLES}{hint}")
    if style == "WSD":
        if _get(optim, "lr_wsd_decay_steps") is None:
            raise ValueError(f"{OPTIM}.lr_decay_style='WSD' needs {OPTIM}.lr_wsd_decay_steps (got null)")
        if _get(optim, "lr_wsd_decay_style") not in WSD_STYLES:
            raise ValueError(f"{OPTIM}.lr_wsd_decay_style={_get(optim, 'lr_wsd_decay_style')!r}: choose one of "
                             f"{WSD_STYLES}")
    wd_style = _get(optim, "weight_decay_incr_style", "constant")
    if wd_style not in WD_STYLES:
        raise ValueError(f"{OPTIM}.weight_decay_incr_style={wd_style!r}: choose one of {WD_STYLES}")
    min_lr, init = float(_get(optim, "min_lr", 0.0)), float(_get(optim, "lr_warmup_init", 0.0))
    if not 0.0 <= min_lr <= lr:
        raise ValueError(f"{OPTIM}.min_lr={min_lr}: must be in [0, lr={lr}]")
    if init > lr:
        raise ValueError(f"{OPTIM}.lr_warmup_init={init}: must not exceed lr={lr}")
    ratio = _get(optim, "lr_warmup_steps_ratio") or 0.0
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"{OPTIM}.lr_warmup_steps_ratio={ratio}: must be in [0, 1)")
    d = _get(optim, "lr_decay_steps")
    w = _get(optim, "lr_warmup_steps") or 0
    if d is not None and (d <= 0 or w >= d):
        raise ValueError(f"{OPTIM}.lr_decay_steps={d}: must be positive and above lr_warmup_steps={w}")


def build_lr_scheduler(optimizer, optim):
    """verl's scheduler on OPTIMIZER (anything with param_groups), or None (constant lr: module docstring).
    ValueError (check_lr_schedule's, or a schedule asked with no step count: lr_decay_steps null and
    total_training_steps <= 0, or warmup not below the decay steps)."""
    if optimizer is None or optim is None:
        return None
    check_lr_schedule(optim)
    if not _has_megatron_keys(optim):
        return None
    d = decay_steps(optim)
    if d <= 0:
        if _asks_schedule(optim):
            raise ValueError(f"{OPTIM}: lr_decay_style={_get(optim, 'lr_decay_style')!r} with warmup "
                             f"{_get(optim, 'lr_warmup_steps')} / ratio {_get(optim, 'lr_warmup_steps_ratio')} needs "
                             "total_training_steps (verl's trainer sets it) or lr_decay_steps")
        return None
    if warmup_steps(optim, d) >= d:
        raise ValueError(f"{OPTIM}: {warmup_steps(optim, d)} warmup steps, not below the {d} decay steps")
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler

    return get_megatron_optimizer_param_scheduler(optimizer=optimizer, config=optim)


def current_lr(optimizer) -> float:
    """verl's get_megatron_last_lr: the first param group's lr."""
    return float(optimizer.param_groups[0]["lr"])
