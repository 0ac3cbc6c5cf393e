"""mode=async's rollout source: the engine keeps generating the next steps' groups (rl/pipeline.py on rank 0) while
the trainer takes finished ones, P whole groups per update, and pushes each new version in flight
(inflight=switch|pin). Every trained sample is within max_staleness pushes (rl/groups.py's PushClock: one push per
update, whatever number of optimizer steps algo.mini_batches and algo.epochs make of it); a group over it is dropped
and counted. The loss is the decoupled PPO of rl/trainer_step.py (behaviour = the engine's per-token logprobs, proximal = the
trainer before the update).

Evaluation runs on the engine while production goes on: the trainer waits for it, so no push lands meanwhile and
every evaluated token is of one version (pin engines are also asked for that version). A checkpoint records which
groups were trained on or dropped; `resume=true|auto` regenerates the rest (samples in flight at the checkpoint are
generated again: resume continues the run, bit-exactness is promised for mode=sync only). An engine crash restarts
the engine, pushes the current version and generates again what it lost (every source's on those engines: peers).
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from .groups import PushClock, StalenessGate
from .recovery import broadcast
from .source import Rollout, RolloutSource


class AsyncSource(RolloutSource):
    def __init__(self, run, state: dict | None = None, peers: list | None = None):
        """state: the resumed run's (its trained and dropped groups are not generated again); peers: the sources
        of every policy on the same engines (rl/policies_run.py), all regenerating what a restart lost."""
        super().__init__(run, state)
        self.done = set((state or {}).get("groups_done", ()))
        self.peers = peers
        self.pipe = None

    def open(self) -> None:
        """Every rank: the staleness clock; rank 0: the producer started. Versions are counted in the engine's
        numbers (a run of one policy: its own)."""
        run, cfg = self.run, self.run.cfg
        self.clock = PushClock(run.engine_version())     # every rank: staleness in pushes for the step's metrics
        if run.rank == 0:
            from .pipeline import Pipeline

            gate = StalenessGate(cfg.algo.prompts_per_step, cfg.max_staleness, version=run.engine_version())
            self.pipe = Pipeline(run.prod, gate, run.group, done=self.done, pin=run.serving_version() is not None,
                                 order=cfg.take_order)
            self.pipe.start()
        self.trained_samples = self.dropped_samples = self.consumed_tokens = 0
        self.engine_step_s_seen = self.engine_step_s()
        self.engine_busy_s = 0.0          # the engines' stepping seconds in this loop (per engine), across restarts

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.stop()

    def take(self, step: int) -> Rollout:
        """P finished groups within the bound, at the trainer's version (read now)."""
        run = self.run
        version = run.engine_version()
        groups, dropped, wait_s = run._on_engine(
            f"the groups of step {step + 1}", lambda: self.finished(run.cfg.algo.prompts_per_step, version),
            after_restart=self.recover)
        return Rollout([s for grp in groups for s in grp[1]], [grp[0] for grp in groups],
                       {"dropped": dropped, "version": version, "wait_s": wait_s})

    def finished(self, n: int, version: int):
        """Rank 0: n groups within the bound (plans and samples, picklable), the dropped groups' sample count and
        the seconds waited."""
        w0 = self.pipe.wait_s
        ok, dropped = self.pipe.take(n, version)
        return [(g.plan, g.samples) for g in ok], sum(len(g.samples) for g in dropped), self.pipe.wait_s - w0

    def recover(self, index: int) -> None:
        for s in self.peers or [self]:        # every source's streams to that engine were lost
            if s.pipe is not None:
                s.pipe.recover(index)

    def pushed(self) -> None:
        self.clock.serve(self.run.engine_version())
        if self.pipe is not None:
            self.pipe.serve(self.run.engine_version())

    def last(self) -> None:
        if self.pipe is not None:
            self.pipe.stop()          # nothing more to produce: the last evaluation has the engine

    def eval_version(self) -> int | None:
        run = self.run
        return run.engine_version() if run.cfg.inflight == "pin" and run.policy.version > 0 else None

    def state(self) -> dict:
        return {"groups_done": sorted(broadcast(self.pipe.done if self.run.rank == 0 else None))}

    def engine_step_s(self) -> list[float]:
        """Seconds each engine's loop has spent stepping (rank 0; [] elsewhere)."""
        if self.run.rank != 0:
            return []
        try:
            return [float(st["loop"]["step_s"]) for st in self.run.engines.status()]
        except Exception:  # noqa: BLE001 - a figure for the metrics only; a dead engine is handled by the loop
            return [0.0] * len(self.run.engines)

    def figures(self, got: Rollout, batch, proximal) -> dict:
        from ..mismatch import k3_kl
        from .trainer_step import effective_sample_size

        run, samples, version = self.run, got.samples, got.info["version"]
        stale = [self.clock.staleness(version, s.versions) for s in samples]
        hist = Counter(stale)
        self.trained_samples += len(samples)
        self.dropped_samples += got.info["dropped"]
        self.consumed_tokens += sum(len(s.response) for s in samples)
        wall = time.perf_counter() - run.t_rl
        out = {"staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
               "staleness_hist": {str(k): hist.get(k, 0) for k in range(run.cfg.max_staleness + 1)},
               "multi_version_frac": sum(len(set(s.versions)) > 1 for s in samples) / len(samples),
               "dropped": got.info["dropped"],
               "dropped_frac": self.dropped_samples / max(1, self.dropped_samples + self.trained_samples),
               "ess": effective_sample_size(proximal, batch.rollout_logprobs, batch.loss_mask),
               "train_wait_s": got.info["wait_s"], "tokens_consumed_per_s": self.consumed_tokens / wall,
               "engine_versions": [version, run.engine_version()]}    # the engine's numbers: trained at, pushed
        fresh = torch.tensor([k == 0 for k in stale])
        if fresh.any() and proximal.shape[0] == len(samples):    # behaviour = the trainer before the update
            out["fresh_rollout_kl"] = k3_kl(proximal[fresh], batch.rollout_logprobs[fresh],
                                            batch.loss_mask[fresh].to(proximal.dtype))
        if run.rank == 0:
            try:
                sts = run.engines.status()
            except Exception:  # noqa: BLE001 - an engine died meanwhile: the next take finds it and recovers
                return out
            out["versions_live"] = max(len(st.get("versions") or [st.get("version")]) for st in sts)
            out["tokens_produced_per_s"] = self.pipe.produced_tokens / wall
            out["groups_in_flight"] = self.pipe.in_flight()
            out["ahead_max"] = self.pipe.gate.ahead_max
            cur = [float(st["loop"]["step_s"]) for st in sts]
            for now, seen in zip(cur, self.engine_step_s_seen):      # a restarted engine counts from 0
                self.engine_busy_s += (now - seen if now >= seen else now) / len(cur)
            self.engine_step_s_seen = cur
            out["rollout_idle_frac"] = min(1.0, max(0.0, 1.0 - self.engine_busy_s / wall))
            out["train_idle_frac"] = self.pipe.wait_s / wall
        return out

    def summary(self, history: list[dict]) -> dict:
        cfg, last = self.run.cfg, (history[-1] if history else {})
        out = {"max_staleness": cfg.max_staleness, "inflight": cfg.inflight,
               "staleness_max": max((r["staleness_max"] for r in history), default=0),
               "staleness_mean": sum(r["staleness_mean"] for r in history) / max(1, len(history)),
               "dropped_frac": last.get("dropped_frac", 0.0),
               "samples_trained": self.trained_samples,
               "multi_version_frac": sum(r["multi_version_frac"] for r in history) / max(1, len(history)),
               "ess_mean": sum(r["ess"] for r in history) / max(1, len(history)),
               "rollout_idle_frac": last.get("rollout_idle_frac"), "train_idle_frac": last.get("train_idle_frac"),
               "ahead_max": last.get("ahead_max")}
        if last.get("rollout_idle_frac") is not None:     # the engine's own stepping time, not the trainer's view
            out["rollout_busy_frac"] = 1.0 - last["rollout_idle_frac"]
        return out
