"""What a training run shows while it runs and leaves behind: one JSONL record per log call, TensorBoard scalars
(torch.utils.tensorboard), a tqdm bar with live reward, KL and router disagreement, and `plot` drawing the run.

    log = MetricsLogger(out_dir, total_steps=cfg.steps, enabled=rank == 0, resumed_at=ckpt_step_or_None)
    log.log(step, {REWARD: 0.4, KL_R3: 1e-4, DISAGREEMENT: 0.02, "loss": 0.1, "per_layer": {1: 0.03}})
    log.close(); plot(out_dir / "metrics.jsonl", out_dir / "metrics.png")

A record's step is the number of training steps done when it is taken (0: before the first, e.g. the initial
evaluation); the bar stands at the latest. Nested dicts are flattened to "a/b/c" keys. `resumed_at` (the
checkpoint's step) keeps the records of steps <= it and drops the later ones an interrupted run left in the same
directory, in the JSONL and in TensorBoard (purge), so a resumed run's logs read as one run; None (a fresh run)
starts both afresh.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import sys
from pathlib import Path

# the keys plot and the bar read: those of the driver's per-step records
REWARD = "reward"
"""Mean task reward of the step's rollouts."""
EVAL_SUCCESS = "eval"
"""Held-out success rate (logged at evaluation steps only)."""
KL_R3 = "r3_kl"
"""Train-inference KL (k3, rollout tokens) with the rollout's routes replayed in training."""
KL_NO_R3 = "no_r3_kl"
"""The same KL with the training router choosing its own experts."""
DISAGREEMENT = "disagreement"
"""Fraction of the training router's top-k choices not among the rollout's, mean over MoE layers."""
TOKEN_DISAGREEMENT = "token_disagreement"
"""Fraction of tokens where the training router differs from the rollout's in at least one MoE layer."""

JSONL = "metrics.jsonl"
TB_DIR = "tb"
BAR = (("reward", (REWARD,)), ("kl", (KL_R3, KL_NO_R3)), ("dis", ("free_disagreement", DISAGREEMENT)))
"""Progress-bar fields: the first of the keys present in the latest record."""
PANELS = (("Reward (train)", (REWARD,), False), ("Held-out success", (EVAL_SUCCESS,), False),
          ("Train-inference KL", (KL_R3, KL_NO_R3), True),
          ("Router disagreement", ("free_disagreement", "free_token_disagreement", DISAGREEMENT, TOKEN_DISAGREEMENT),
           False),
          ("Tokens with ratio > tau, F(tau)", ("r3_ratio_gt2", "no_r3_ratio_gt2", "r3_ratio_gt5", "no_r3_ratio_gt5"),
           False),
          ("Update", ("grad_norm", "pg_clipfrac"), False))
"""plot's panels: (title, keys, log scale)."""
ASYNC_PANELS = (("Staleness (versions)", ("staleness_max", "staleness_mean"), False),
                ("Dropped, ESS, idle", ("dropped_frac", "ess", "rollout_idle_frac", "train_idle_frac"), False))
"""plot's extra row for a mode=async run (rl/async_source.py's per-step keys)."""
LABELS = {REWARD: "reward", EVAL_SUCCESS: "held-out success", KL_R3: "with R3", KL_NO_R3: "without R3",
          DISAGREEMENT: "decisions, on replayed routes", TOKEN_DISAGREEMENT: "tokens (>= 1 layer), on replayed routes",
          "free_disagreement": "decisions", "free_token_disagreement": "tokens (>= 1 layer)",
          "r3_ratio_gt2": "tau=2, with R3", "no_r3_ratio_gt2": "tau=2, without R3", "r3_ratio_gt5": "tau=5, with R3",
          "no_r3_ratio_gt5": "tau=5, without R3", "grad_norm": "grad norm", "pg_clipfrac": "clip fraction",
          "staleness_max": "max", "staleness_mean": "mean",
          "dropped_frac": "dropped (cumulative)", "ess": "ESS of IS weights", "rollout_idle_frac": "engine idle",
          "train_idle_frac": "trainer idle"}


BY_SOURCE = {REWARD: "reward/", EVAL_SUCCESS: "eval/"}
"""Per data_source figures of a dataset mixing sources: "reward/SOURCE", "eval/SOURCE" (drawn beside the mean)."""


def reward_figures(scores: list[float], extras: list[dict], sources: list[str]) -> dict:
    """A step's reward figures beyond the mean: each extra key of a dict reward (its mean over the responses that
    return it, "reward_extra/KEY") and, when the responses come from several data sources, each source's mean
    reward ("reward/SOURCE")."""
    out, sums = {}, {}
    for e in extras:
        for k, v in e.items():
            sums.setdefault(k, []).append(v)
    for k, vs in sorted(sums.items()):
        out[f"reward_extra/{k}"] = sum(vs) / len(vs)
    by = {}
    for s, r in zip(sources, scores):
        by.setdefault(s, []).append(r)
    if len(by) > 1:
        for src, rs in sorted(by.items()):
            out[f"{BY_SOURCE[REWARD]}{src}"] = sum(rs) / len(rs)
    return out


def flatten(metrics: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a/b": 1}; tensors and numpy scalars become Python numbers."""
    out = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
            continue
        if hasattr(v, "item") and hasattr(v, "shape") and math.prod(v.shape) == 1:     # tensor / numpy scalar
            v = v.item()
        out[key] = v
    return out


def _scalar(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, numbers.Real):
        return float(v)
    return None


def read_jsonl(path) -> list[dict]:
    """The records of a metrics file, in order (a torn last line from a killed run is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsLogger:
    """JSONL + TensorBoard + tqdm for rank 0; with enabled=False every call does nothing (other ranks)."""

    def __init__(self, out_dir, *, total_steps: int, enabled: bool = True, resumed_at: int | None = None,
                 bar: bool = True, bar_file=None):
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps={total_steps!r} must be an integer >= 1")
        if resumed_at is not None and (not isinstance(resumed_at, int) or resumed_at < 0):
            raise ValueError(f"resumed_at={resumed_at!r} must be None or an integer >= 0")
        done = 0 if resumed_at is None else resumed_at
        self.enabled = enabled
        self.last: dict = {}
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / JSONL
        self._keep_until(resumed_at)
        self._jsonl = open(self.jsonl_path, "a")
        self.writer = SummaryWriter(str(self.dir / TB_DIR), purge_step=done + 1 if resumed_at is not None else 0)
        self.bar = tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True,
                        file=bar_file or sys.stderr, disable=not bar, mininterval=0)

    def _keep_until(self, resumed_at: int | None) -> None:
        if not self.jsonl_path.exists():
            return
        keep = [] if resumed_at is None else [r for r in read_jsonl(self.jsonl_path) if r.get("step", 0) <= resumed_at]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.jsonl_path)

    def log(self, step: int, metrics: dict) -> None:
        """One record: JSONL line (flushed), TensorBoard scalars at `step`, the bar moved to `step`."""
        if not self.enabled:
            return
        import time

        flat = flatten(metrics)
        if flat.pop("step", step) != step:
            raise ValueError(f"metrics carry step={metrics['step']!r}, logged as step {step}")
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **flat}) + "\n")
        self._jsonl.flush()
        for k, v in flat.items():
            x = _scalar(v)
            if x is not None:
                self.writer.add_scalar(k, x, step)
        self.last.update(flat)
        post = {}
        for label, keys in BAR:
            k = next((k for k in keys if k in self.last and _scalar(self.last[k]) is not None), None)
            if k is not None:
                post[label] = f"{self.last[k]:.3g}"
        self.bar.set_postfix(post, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)         # redraws the bar (mininterval=0)
        else:
            self.bar.refresh()                         # a record of the current step: new figures, no advance

    def note(self, text: str) -> None:
        """A line above the bar (e.g. an engine restart), without breaking it."""
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        if not self.enabled or self._jsonl.closed:
            return
        self._jsonl.close()
        self.writer.close()
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def plot(jsonl_path, png_path, *, title: str | None = None) -> Path:
    """Reward, held-out success, train-inference KL with and without R3, router disagreement (decisions and
    tokens), the fraction of tokens with ratio > 2 with and without R3, grad norm and clip fraction over steps, as a
    3x2 PNG (a panel whose keys were never logged says so); a mode=async run adds a row: staleness, and the dropped
    fraction, effective sample size and idle fractions."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_jsonl(jsonl_path)
    if not records:
        raise ValueError(f"{jsonl_path}: no metrics records to plot")
    panels = PANELS + (ASYNC_PANELS if any("staleness_max" in r for r in records) else ())
    rows = len(panels) // 2
    fig = Figure(figsize=(10, 3.5 * rows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2).ravel()
    for ax, (name, keys, log) in zip(axes, panels):
        drawn = 0
        for main_key, prefix in BY_SOURCE.items():       # a dataset mixing sources: each source beside the mean
            if main_key in keys:
                keys = keys + tuple(sorted({k for r in records for k in r if k.startswith(prefix)}))
        for k in keys:
            pts = [(r["step"], r[k]) for r in records if _scalar(r.get(k)) is not None and math.isfinite(r[k])]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, ms=3, label=LABELS.get(k, k))
            drawn += 1
            if log and min(ys) > 0:
                ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn > 1 or (drawn and len(keys) > 1):
            ax.legend()
        if not drawn:
            ax.text(0.5, 0.5, f"not logged ({', '.join(keys)})", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    fig.suptitle(title or str(Path(jsonl_path).parent))
    fig.tight_layout()
    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    return png


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.rl.metrics", description="Plot a run's metrics.jsonl")
    ap.add_argument("jsonl")
    ap.add_argument("png")
    a = ap.parse_args(argv)
    if not Path(a.jsonl).is_file():
        print(f"{ap.prog}: error: {a.jsonl} is not a file", file=sys.stderr)
        return 2
    try:
        print(plot(a.jsonl, a.png))
    except ValueError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
