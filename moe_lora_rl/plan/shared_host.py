"""Sync vs async RL steps/min when the rollout engine and the trainer SHARE one host's C CPU cores (the CPU main job:
torchrun with the trainer ranks + one vLLM engine process on the same machine), from figures benches measure.

Inputs, seconds per RL step: rollout on 1 core (r1) and on all C cores (rC), training on 1 core (t1) and on all C
cores (tC), the adapter refit push (x, default 0), the core count C and the staleness bound k.

- Sync: the phases take turns, each given every core: sync = rC + tC + x. That is the best synchronous run; the
  rollout phase is single-threaded, so more cores barely help it (measured for 20 steps: 10.1 s on one core,
  11.4 s on two), while training scales (28.5 s on one, 14.2 s on two).
- Async (k >= 1): the producer may run a version ahead, so rollout of step n+1 overlaps training of step n and, in
  steady state, the step is set by throughput, not by the chain. Three lower bounds, the largest wins:
    cores:   (r1 + t1 + x) / C  the total single-core work spread perfectly over C cores;
    rollout: r1                 rollout is single-threaded, no faster than on its one core;
    train:   tC + x             training and its push run no faster than with every core.
  async = max(cores, rollout, train). No staleness term at k >= 1: one version of lead already lets the phases
  overlap fully; k = 0 would be the sync run and is refused (ValueError), as the GPU planner refuses it in async mode.
  Ties name the phase (rollout, then train) before cores: adding cores would not shorten the step.
- Response lengths (optional, HostLengths): the measured rollout figures are the SYNCHRONOUS rollout of a batch of
  n answers, which runs until the longest ends, the batch shrinking as short ones finish. A decode step of the
  full batch costs d; of k answers d * (phi + (1 - phi) * k / n), phi the share that does not shrink with the batch
  (weights read, per-step overheads; 1 = memory-bound). Sync then takes d * sum_k G_k (phi + (1 - phi) k / n)
  (formulas.shrinking_batch_seconds), async keeps the n slots full, d * mean per batch of n. The async rollout
  bound becomes r1 * f with f = mean / sum_k G_k (...) (1 for one length), and a fourth bound appears:
    staleness: r1 * g / k       the batch's longest answer, g = E[max of n] / sum_k G_k (...), generated at full
                                occupancy, may span at most k steps (PipelineRL's max_staleness).
  With one length f = g = 1, the staleness bound r1 / k never exceeds the rollout bound: the model above, unchanged.
  Only the engine's decode steps shrink with the batch: with e the share of the measured rollout spent in them
  (engine_frac; the rest is pushes, prompts, rewards, logprobs and routes taken back), the rollout factor is
  1 - e + e * f and the longest answer's e * g. phi and e come from the run itself: a decode step's seconds fitted as
  fixed_s + per_seq_s * b over the engine's steps (rollout/kv_meter.step_fit) give phi = fixed_s / (fixed_s +
  per_seq_s * n) (from_fit), and e = the engine's decode seconds over the rollout phase's.
- overlap_bound = sync / ((r1 + t1) / C), as the issue defines it: the sync step over the work of both phases
  spread over the cores, refit left out of the denominator. (11.4 + 14.2) / ((10.1 + 28.5) / 2) = 1.33.
- predicted speedup = sync / async; steps/min = 60 / step. With C = 1 the C-core figures are the 1-core figures
  (refused otherwise), async = r1 + t1 + x = sync and the speedup is 1: on one core nothing can overlap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import formulas as F
from .lengths import LengthDist


@dataclass(frozen=True)
class HostPhases:
    """Seconds per RL step of each phase on one host: `_1` on one core, `_c` on all `cores` cores."""
    rollout_1: float
    rollout_c: float
    train_1: float
    train_c: float
    cores: int
    refit: float = 0.0

    def __post_init__(self):
        for name in ("rollout_1", "rollout_c", "train_1", "train_c"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a finite number of seconds > 0")
        r = self.refit
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
            raise ValueError(f"refit={r!r}: must be a finite number of seconds >= 0")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"cores={self.cores!r}: must be an integer >= 1")
        if self.cores == 1 and (self.rollout_c != self.rollout_1 or self.train_c != self.train_1):
            raise ValueError(f"cores=1: the all-core figures are the one-core figures, got rollout "
                             f"{self.rollout_1!r} vs {self.rollout_c!r}, train {self.train_1!r} vs {self.train_c!r}")


@dataclass(frozen=True)
class HostLengths:
    """The answers of the measured synchronous rollout: their distribution, the engine's batch n (answers run at
    once) and phi, the share of a full-batch decode step that does not shrink with the batch (module docstring).
    With a linear step cost the distribution matters through its mean and the batch's expected longest answer
    only: sum_k G_k = E[max] and sum_k k G_k = n * mean, so sync_steps = phi * E[max] + (1 - phi) * mean.
    occupancy: the synchronous engine's sequences per decode step as a run measured it (n * mean / E[max]); given,
    it sets E[max] = n * mean / occupancy in place of the distribution's tail (bench async). occupancy_async: the
    pipelined engine's sequences per decode step (default n, its slots kept full): a batch then costs
    mean * (phi * n / o + 1 - phi) full-batch steps, its longest answer E[max] * (phi + (1 - phi) * o / n)."""
    dist: LengthDist
    batch: int
    fixed_frac: float = 1.0
    engine_frac: float = 1.0
    occupancy: float | None = None
    occupancy_async: float | None = None

    def __post_init__(self):
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch={self.batch!r}: must be an integer >= 1")
        f = self.fixed_frac
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"fixed_frac={f!r}: a share of the decode step in [0, 1]")
        e = self.engine_frac
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"engine_frac={e!r}: the share of the rollout spent in engine steps, in (0, 1]")
        o = self.occupancy
        if o is not None and (isinstance(o, bool) or not isinstance(o, (int, float)) or not 1 <= o <= self.batch):
            raise ValueError(f"occupancy={o!r}: sequences per decode step, in [1, batch={self.batch}]")
        o = self.occupancy_async
        if o is not None and (isinstance(o, bool) or not isinstance(o, (int, float)) or not 1 <= o <= self.batch):
            raise ValueError(f"occupancy_async={o!r}: sequences per decode step, in [1, batch={self.batch}]")

    @classmethod
    def from_fit(cls, dist: LengthDist, batch: int, fit: dict, engine_frac: float = 1.0,
                 occupancy: float | None = None) -> "HostLengths":
        """phi from a decode step's fitted seconds, fixed_s + per_seq_s * b (rollout/kv_meter.step_fit), at the
        full batch; a negative part of the fit (noise) counts as zero."""
        a, c = max(0.0, fit["fixed_s"]), max(0.0, fit["per_seq_s"])
        if a + c <= 0:
            raise ValueError(f"step fit {fit!r}: a decode step must cost some seconds")
        return cls(dist, batch, a / (a + c * batch), engine_frac, occupancy)

    def longest(self) -> float:
        """E[the batch's longest answer] in decode steps: measured (occupancy) or from the distribution."""
        if self.occupancy is not None:
            return self.batch * self.dist.mean / self.occupancy
        return self.dist.expected_max(self.batch)

    def occupancy_sync(self) -> float:
        """The synchronous engine's sequences per decode step: tokens of the batch over its longest answer."""
        return self.batch * self.dist.mean / self.longest()

    def sync_steps(self) -> float:
        """The synchronous rollout in full-batch decode steps: sum_k G_k (phi + (1 - phi) k / n)."""
        return self.fixed_frac * self.longest() + (1 - self.fixed_frac) * self.dist.mean

    def _async_occupancy(self) -> float:
        return self.batch if self.occupancy_async is None else self.occupancy_async

    def async_factor(self) -> float:
        """async rollout of a batch (at occupancy_async, default full slots) over the synchronous one: 1 - e + e * f."""
        n, phi, o = self.batch, self.fixed_frac, self._async_occupancy()
        f = self.dist.mean * (phi * n / o + 1 - phi) / self.sync_steps()
        return 1 - self.engine_frac + self.engine_frac * f

    def longest_factor(self) -> float:
        """e * g: the batch's longest answer at the async occupancy over the synchronous rollout."""
        n, phi, o = self.batch, self.fixed_frac, self._async_occupancy()
        return self.engine_frac * self.longest() * (phi + (1 - phi) * o / n) / self.sync_steps()


def sync_step_s(p: HostPhases) -> float:
    """The phases take turns, each with every core."""
    return p.rollout_c + p.train_c + p.refit


def async_bounds_s(p: HostPhases, max_staleness: int = 1, lengths: HostLengths | None = None) -> dict[str, float]:
    """The lower bounds on the async step, keyed by what sets each (see the module docstring)."""
    f, g = (lengths.async_factor(), lengths.longest_factor()) if lengths else (1.0, 1.0)
    return {"cores": (p.rollout_1 * f + p.train_1 + p.refit) / p.cores, "rollout": p.rollout_1 * f,
            "train": p.train_c + p.refit, "staleness": p.rollout_1 * g / max_staleness}


def async_step_s(p: HostPhases, max_staleness: int, lengths: HostLengths | None = None) -> tuple[float, str]:
    """The async step and what bounds it ("rollout" | "train" | "staleness" | "cores")."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 1:
        raise ValueError(f"max_staleness={max_staleness!r}: asynchronous RL needs an integer >= 1 (0 is the sync run)")
    b = async_bounds_s(p, max_staleness, lengths)
    step = max(b.values())
    return step, next(k for k in ("rollout", "train", "staleness", "cores") if b[k] == step)


def overlap_bound(p: HostPhases) -> float:
    """sync / ((r1 + t1) / C), exactly as the issue defines it (refit not in the denominator)."""
    return sync_step_s(p) / ((p.rollout_1 + p.train_1) / p.cores)


def predict(phases: HostPhases, max_staleness: int, lengths: HostLengths | None = None) -> dict:
    """Sync and async steps/min on the shared host, the predicted speedup, the overlap bound, the async limit, and
    the seed's invariants: the staleness the layout implies (vs the bound) and, given lengths, the answer tokens/s
    the engine alone (async, on its one core) and the trainer alone (every core) can take."""
    sync = sync_step_s(phases)
    step, limit = async_step_s(phases, max_staleness, lengths)
    g = lengths.longest_factor() if lengths else 1.0
    out = {"sync_step_s": sync, "async_step_s": step, "sync_steps_per_min": 60.0 / sync,
           "async_steps_per_min": 60.0 / step, "predicted_speedup": sync / step,
           "overlap_bound": overlap_bound(phases), "limit": limit,
           "implied_staleness": F.implied_staleness(1, phases.rollout_1 * g, step)}
    if lengths:
        tokens = lengths.batch * lengths.dist.mean
        out.update({"async_rollout_factor": lengths.async_factor(), "longest_factor": g,
                    "produced_tokens_per_s": tokens / (phases.rollout_1 * lengths.async_factor()),
                    "consumed_tokens_per_s": tokens / (phases.train_c + phases.refit)})
    return out


def predict_policies(phases: HostPhases, policies: int, steps: int, setup_s: float = 0.0,
                     eval_s: float = 0.0) -> dict:
    """N policies of `steps` steps each (phases: one policy's, as a run of one measures them), together on one base
    and engine (rl/policies_run.py) vs each run alone, one after the other. Together, the policies take turns and
    the next policy's rollout overlaps this one's training: in steady state a turn is set by throughput, as the
    async step at a lead of one version (async_bounds_s without its staleness term: the rollout begun ahead is
    the next policy's, whose version is final, so no staleness arises). Apart, every run pays its own setup
    (setup_s: a job's seconds before its RL loop) and takes synchronous steps; both pay each policy's evaluation
    (eval_s). Returns the seconds of both, the turn, what bounds it, and the predicted speedups (job and loop)."""
    if isinstance(policies, bool) or not isinstance(policies, int) or policies < 1:
        raise ValueError(f"policies={policies!r}: must be an integer >= 1")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be an integer >= 1")
    for name, v in (("setup_s", setup_s), ("eval_s", eval_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}={v!r}: must be a finite number of seconds >= 0")
    sync = sync_step_s(phases)
    if policies == 1:
        turn, limit = sync, "alone"
    else:
        b = {k: v for k, v in async_bounds_s(phases).items() if k != "staleness"}
        turn = max(b.values())
        limit = next(k for k in ("rollout", "train", "cores") if b[k] == turn)
    loop_apart, loop_together = policies * steps * sync, policies * steps * turn
    apart = policies * (setup_s + eval_s) + loop_apart
    together = setup_s + policies * eval_s + loop_together
    return {"apart_s": apart, "together_s": together, "turn_s": turn, "sync_step_s": sync, "limit": limit,
            "predicted_speedup": apart / together, "predicted_speedup_loop": loop_apart / loop_together}
