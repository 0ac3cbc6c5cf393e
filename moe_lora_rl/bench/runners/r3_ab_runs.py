"""bench r3_ab's named settings and what is read from its runs (pure): the held-out curve's last two evaluations,
whether a run collapsed, each step's figures, and the A/B's summary over seeds."""
from __future__ import annotations

HELD_OUT_512 = ["eval_every=10", "data.eval_samples=4"]
"""Held-out success every 10 steps on 512 samples: the long recipe's 128 held-out problems, 4 samples each (its
n_eval is kept: the warm start is trained on the problems it does not hold out, and n_eval=128 is the one cached);
one evaluation's standard error at rates near 0.4 is then 0.022 if every problem had the same rate, up to 0.043
where each problem is solved always or never (the samples of one problem then agree)."""
LONG_W500 = ["--config-name=long", "algo.rollout_is=off", *HELD_OUT_512]
"""The long recipe (answers of 60-400 tokens, 2 mini-batches a rollout) without its rollout correction; its warm
start (WARM) is the 500-step one, where held-out success is ~0.40 at temperature 1 (docs/long_reasoning.md)."""
SETTINGS = {
    "default": [],
    "lr3e-3_no_is": ["algo.lr=3e-3", "algo.rollout_is=off"],
    "lr1e-2_no_is": ["algo.lr=1e-2", "algo.rollout_is=off"],
    "bf16_no_is": ["runtime.train_dtype=bfloat16", "algo.rollout_is=off"],
    "mini4_no_is": ["algo.mini_batches=4", "algo.rollout_is=off"],
    "long": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off"],
    "medium": ["--config-name=long", "data.mix=medium", "data.eval_samples=2", "algo.max_response_tokens=160",
               "algo.mini_batches=4", "algo.rollout_is=off"],
    "long_lr3e-3": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off", "algo.lr=3e-3"],
    "long_async": ["--config-name=long", "algo.mini_batches=4", "algo.rollout_is=off", "mode=async",
                   "max_staleness=2"],
    "long_w500_lr3e-4": [*LONG_W500, "algo.lr=3e-4"],
    "long_w500_lr6e-4": [*LONG_W500, "algo.lr=6e-4"],
    "long_w500_mini4_lr3e-4": [*LONG_W500, "algo.mini_batches=4", "algo.lr=3e-4"],
    "long_w500_mini4_lr1e-3": [*LONG_W500, "algo.mini_batches=4", "algo.lr=1e-3"],
    "long_w500_async_lr3e-4": [*LONG_W500, "algo.lr=3e-4", "mode=async", "max_staleness=2"],
}
"""Named settings: hydra overrides added to both replay modes. default: the main job as it is; lr*/bf16*: the
stresses tried on it (README, "What R3 changes"): a larger learning rate, or Megatron in bf16 too, without the
rollout correction; mini4_no_is: four mini-steps per rollout batch (the LFM report's setting) without it. long*:
the long-reasoning job (recipes/long.yaml) where the literature sees runs without R3 collapse: several mini-steps
per rollout (4), no truncated IS, bf16 rollouts at temperature 1; with a larger
learning rate, or asynchronous with a staleness bound of 2; medium: the same on data.mix=medium (6-14 digits,
40-150 tokens), where the warm-started model succeeds often enough for GRPO to learn. long_w500_*: the long A/B
(docs/r3.md): the long recipe (2 mini-batches) from its 500-step warm start, no rollout correction, 60 steps,
held-out on 512 samples; at lr 3e-4 (where the R3 run holds) or 6e-4 (between it and 1e-3, where it falls), with
4 mini-batches (the literature's several mini-steps; at lr 3e-4, or at lr 1e-3, where the R3 run with 2 mini-batches
already falls), or asynchronous at a staleness bound of 2."""
WARM = {name: ["model.warm_steps=500"] for name in SETTINGS if name.startswith("long_w500")}
"""A setting's warm start where no --model (or model.warm_* override) chooses the model."""
STEPS = {name: 60 for name in WARM}
"""A setting's steps where --steps is not given (else the recipe's)."""
DROP = 0.1
"""collapsed(): how far below its start or its best a run's last two evaluations must fall (one evaluation's
standard error at these rates is ~0.02-0.04, so a single noisy evaluation does not count)."""


def last2(evals: dict) -> float:
    """The mean of a run's last two held-out evaluations (the one, if there is only one); keys: steps, as ints or
    as the strings JSON makes of them."""
    vals = [evals[k] for k in sorted(evals, key=int)]
    if not vals:
        raise ValueError("a run without held-out evaluations has no last two")
    return sum(vals[-2:]) / len(vals[-2:])


def collapsed(evals: dict, drop: float = DROP) -> bool:
    """The mean of the last two evaluations is `drop` or more below the first (the start) or below the best."""
    vals = [evals[k] for k in sorted(evals, key=int)]
    end = last2(evals)
    return round(vals[0] - end, 9) >= drop or round(max(vals) - end, 9) >= drop


def curve(records: list[dict], replay: str) -> list[dict]:
    """Per step: held-out success (where evaluated); of the trained policy (R3: the trainer on the rollout's
    routes; off: routing itself) against the sampler: the KL, F(2), F(5), the fraction of sequences holding a token
    past ratio 2, the largest per-sequence |sum of log-ratios|, the KL of each response's first and second half;
    grad norm, clip fraction and mean response length."""
    pre = "r3_" if replay == "r3" else "no_r3_"
    names = {"kl": pre + "kl", "f2": pre + "ratio_gt2", "f5": pre + "ratio_gt5", "seq_f2": pre + "seq_ratio_gt2",
             "seq_log_ratio_max": pre + "seq_log_ratio_max", "kl_first_half": pre + "kl_first_half",
             "kl_second_half": pre + "kl_second_half", "grad_norm": "grad_norm",
             "pg_clipfrac": "pg_clipfrac", "response_len": "response_len"}
    return [{"step": r["step"], **({"eval": r["eval"]} if "eval" in r else {}),
             **{k: r[src] for k, src in names.items() if src in r}} for r in records]


def summarize(runs: dict, seeds: list[int]) -> dict:
    """The A/B's figures from each run's summary (runs: (replay, seed) -> summary.json), means over seeds."""
    def mean(replay, key):
        return sum(runs[replay, s][key] for s in seeds) / len(seeds)

    return {"eval_start": mean("r3", "eval_start"), "eval_end_r3": mean("r3", "eval_end"),
            "eval_end_off": mean("off", "eval_end"),
            "eval_last2_r3": sum(last2(runs["r3", s]["evals"]) for s in seeds) / len(seeds),
            "eval_last2_off": sum(last2(runs["off", s]["evals"]) for s in seeds) / len(seeds),
            "kl_r3": mean("r3", "kl_mean_r3"),
            "kl_off": mean("off", "kl_mean_no_r3"), "ratio_gt2_r3": mean("r3", "ratio_gt2"),
            "ratio_gt2_off": mean("off", "ratio_gt2_no_r3"), "ratio_gt5_r3": mean("r3", "ratio_gt5"),
            "ratio_gt5_off": mean("off", "ratio_gt5_no_r3"), "seq_ratio_gt2_r3": mean("r3", "seq_ratio_gt2_r3"),
            "seq_ratio_gt2_off": mean("off", "seq_ratio_gt2_no_r3"),
            "seq_log_ratio_max_r3": mean("r3", "seq_log_ratio_max_r3"),
            "seq_log_ratio_max_off": mean("off", "seq_log_ratio_max_no_r3"),
            "kl_halves_r3": [mean("r3", "kl_first_half_r3"), mean("r3", "kl_second_half_r3")],
            "kl_halves_off": [mean("off", "kl_first_half_no_r3"), mean("off", "kl_second_half_no_r3")],
            "response_len_r3": mean("r3", "response_len_mean"), "response_len_off": mean("off", "response_len_mean"),
            "grad_norm_r3": mean("r3", "grad_norm_mean"),
            "grad_norm_off": mean("off", "grad_norm_mean"), "clipfrac_r3": mean("r3", "clipfrac_mean"),
            "clipfrac_off": mean("off", "clipfrac_mean"),
            "collapsed_r3": sum(collapsed(runs["r3", s]["evals"]) for s in seeds),
            "collapsed_off": sum(collapsed(runs["off", s]["evals"]) for s in seeds),
            "evals": {f"{r}-s{s}": runs[r, s]["evals"] for r, s in sorted(runs)}}
