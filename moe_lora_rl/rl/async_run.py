"""mode=async: the engine keeps generating the next steps' groups (rl/pipeline.py on rank 0) while the trainer takes
finished ones, P whole groups per update, and pushes each new version in flight (inflight=switch|pin). Every
trained sample is within max_staleness pushes (rl/groups.py's PushClock: one push per update, whatever number of
optimizer steps algo.mini_batches and algo.epochs make of it); a group over it is dropped and counted. The loss is
the decoupled PPO of rl/step.py (behaviour = the engine's per-token logprobs, proximal = the trainer before the
update).

Evaluation runs on the engine while production goes on: the trainer waits for it, so no push lands meanwhile and
every evaluated token is of one version (pin engines are also asked for that version). A checkpoint records which
groups were trained on or dropped; `resume=true|auto` regenerates the rest (samples in flight at the checkpoint are
generated again: resume continues the run, bit-exactness is promised for mode=sync only). An engine crash restarts
the engine, pushes the current version and generates again what it lost.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from .groups import PushClock, StalenessGate
from .recovery import broadcast
from .run import GRPORun


class AsyncGRPORun(GRPORun):
    def loop(self, start: int, history: list, evals: dict, state: dict) -> None:
        self.open_pipe(state)
        try:
            for step in range(start, self.cfg.steps):
                self.record_async(step, self.async_step(step), history, evals)
        finally:
            self.close_pipe()

    def open_pipe(self, state: dict) -> None:
        """Every rank: the staleness clock; rank 0: the producer started (a resumed run's trained and dropped groups
        are not generated again). Versions are counted in the engine's numbers (a run of one policy: its own)."""
        cfg, a = self.cfg, self.cfg.algo
        done = set(state.get("groups_done", ()))
        self.pipe = None
        self.clock = PushClock(self.engine_version())     # every rank: staleness in pushes for the step's metrics
        if self.rank == 0:
            from .pipeline import Pipeline

            gate = StalenessGate(a.prompts_per_step, cfg.max_staleness, version=self.engine_version())
            self.pipe = Pipeline(self.prod, gate, self.group, done=done, pin=self.serving_version() is not None,
                                 order=cfg.take_order)
            self.pipe.start()
        self.trained_samples = self.dropped_samples = self.consumed_tokens = 0
        self._engine_step_s_seen = self._engine_step_s()
        self.engine_busy_s = 0.0          # the engines' stepping seconds in this loop (per engine), across restarts

    def close_pipe(self) -> None:
        if getattr(self, "pipe", None) is not None:
            self.pipe.stop()

    def record_async(self, step: int, m: dict, history: list, evals: dict) -> None:
        """A finished step: the evaluation if due (the producer stopped before the last), the metrics line, the
        checkpoint if due."""
        if step + 1 == self.cfg.steps and self.rank == 0:
            self.pipe.stop()          # nothing more to produce: the last evaluation has the engine
        if self.eval_due(step + 1):
            evals[step + 1] = m["eval"] = self.evaluate(self._eval_version(), after_restart=self.pipe_recover)
        m["wall_s"] = time.perf_counter() - self.t_rl
        m["eval_s"] = self.eval_s             # seconds of evaluation so far (in wall_s)
        history.append(m)
        self.log.log(step + 1, m)
        self.stepped(step)
        if self.checkpoint_due(step + 1):
            self.save(step + 1, history, evals,
                      groups_done=sorted(broadcast(self.pipe.done if self.rank == 0 else None)))

    def async_step(self, step: int) -> dict:
        a = self.cfg.algo
        version = self.engine_version()
        got = self._on_engine(f"the groups of step {step + 1}",
                              lambda: self._take(a.prompts_per_step, version), after_restart=self.pipe_recover)
        groups, dropped, wait_s = got
        plans = [grp[0] for grp in groups]
        samples = [s for grp in groups for s in grp[1]]
        m, batch, proximal = self.train(samples, plans)
        if self.served is not None:
            self.served.record(step + 1, samples)
        pushed = 0
        if not m.get("skipped"):
            pushed = self.push(after_restart=self.pipe_recover)     # in flight: the engine keeps generating
            self.clock.serve(self.engine_version())
            if self.rank == 0:
                self.pipe.serve(self.engine_version())
        return {**m, **self.step_metrics(samples, dropped, version, batch, proximal, wait_s),
                "refit_bytes": pushed, "version": self.policy.version,
                "engine_versions": [version, self.engine_version()]}   # the engine's numbers: trained at, pushed

    def _take(self, n: int, version: int):
        """Rank 0: n groups within the bound (plans and samples, picklable), the dropped groups' sample count and
        the seconds waited."""
        w0 = self.pipe.wait_s
        ok, dropped = self.pipe.take(n, version)
        return [(g.plan, g.samples) for g in ok], sum(len(g.samples) for g in dropped), self.pipe.wait_s - w0

    def pipe_recover(self, index: int) -> None:
        self.pipe.recover(index)

    def _eval_version(self) -> int | None:
        return self.engine_version() if self.cfg.inflight == "pin" and self.policy.version > 0 else None

    def _engine_step_s(self) -> list[float]:
        """Seconds each engine's loop has spent stepping (rank 0; [] elsewhere)."""
        if self.rank != 0:
            return []
        try:
            return [float(st["loop"]["step_s"]) for st in self.engines.status()]
        except Exception:  # noqa: BLE001 - a figure for the metrics only; a dead engine is handled by the loop
            return [0.0] * len(self.engines)

    def step_metrics(self, samples, dropped: int, version: int, batch, proximal, wait_s: float) -> dict:
        from ..mismatch import k3_kl
        from .samples import token_versions
        from .step import effective_sample_size

        stale = [self.clock.staleness(version, s.versions) for s in samples]
        hist = Counter(stale)
        self.trained_samples += len(samples)
        self.dropped_samples += dropped
        self.consumed_tokens += sum(len(s.response) for s in samples)
        wall = time.perf_counter() - self.t_rl
        out = {"staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
               "staleness_hist": {str(k): hist.get(k, 0) for k in range(self.cfg.max_staleness + 1)},
               "multi_version_frac": sum(len(set(s.versions)) > 1 for s in samples) / len(samples),
               "dropped": dropped,
               "dropped_frac": self.dropped_samples / max(1, self.dropped_samples + self.trained_samples),
               "ess": effective_sample_size(proximal, batch.rollout_logprobs, batch.loss_mask),
               "train_wait_s": wait_s, "tokens_consumed_per_s": self.consumed_tokens / wall,
               "rollout_versions": token_versions(samples)}
        fresh = torch.tensor([k == 0 for k in stale])
        if fresh.any() and proximal.shape[0] == len(samples):    # behaviour = the trainer before the update
            out["fresh_rollout_kl"] = k3_kl(proximal[fresh], batch.rollout_logprobs[fresh],
                                            batch.loss_mask[fresh].to(proximal.dtype))
        if self.rank == 0:
            try:
                sts = self.engines.status()
            except Exception:  # noqa: BLE001 - an engine died meanwhile: the next take finds it and recovers
                return out
            out["versions_live"] = max(len(st.get("versions") or [st.get("version")]) for st in sts)
            out["tokens_produced_per_s"] = self.pipe.produced_tokens / wall
            out["groups_in_flight"] = self.pipe.in_flight()
            out["ahead_max"] = self.pipe.gate.ahead_max
            cur = [float(st["loop"]["step_s"]) for st in sts]
            for now, seen in zip(cur, self._engine_step_s_seen):      # a restarted engine counts from 0
                self.engine_busy_s += (now - seen if now >= seen else now) / len(cur)
            self._engine_step_s_seen = cur
            out["rollout_idle_frac"] = min(1.0, max(0.0, 1.0 - self.engine_busy_s / wall))
            out["train_idle_frac"] = self.pipe.wait_s / wall
        return out

    def summary(self, history: list[dict], evals: dict, wall: float) -> dict:
        out = super().summary(history, evals, wall)
        last = history[-1] if history else {}
        out.update({"max_staleness": self.cfg.max_staleness, "inflight": self.cfg.inflight,
                    "staleness_max": max((r["staleness_max"] for r in history), default=0),
                    "staleness_mean": sum(r["staleness_mean"] for r in history) / max(1, len(history)),
                    "dropped_frac": last.get("dropped_frac", 0.0),
                    "samples_trained": self.trained_samples,
                    "multi_version_frac": sum(r["multi_version_frac"] for r in history) / max(1, len(history)),
                    "ess_mean": sum(r["ess"] for r in history) / max(1, len(history)),
                    "rollout_idle_frac": last.get("rollout_idle_frac"), "train_idle_frac": last.get("train_idle_frac"),
                    "ahead_max": last.get("ahead_max")})
        if last.get("rollout_idle_frac") is not None:     # the engine's own stepping time, not the trainer's view
            out["rollout_busy_frac"] = 1.0 - last["rollout_idle_frac"]
        return out
