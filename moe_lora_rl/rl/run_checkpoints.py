"""The main job's checkpoints, a mixin of rl/run.GRPORun: what a resume must keep (run_meta), saving a step's
adapters, optimizer and loop state, whether this start resumes (resume=true|auto, failed resumes recorded and never
loaded again: checkpoint/attempts.py) and loading the latest checkpoint. Uses the run's cfg, out, rank, path and
policy."""
from __future__ import annotations

import sys

from .recovery import broadcast


class RunCheckpoints:
    def run_meta(self) -> dict:
        """What must not change across a resume (the layout may: adapters and optimizer state reshard)."""
        from dataclasses import asdict

        from ..checkpoint.api import describe_run

        return describe_run(self.path, self.policy.lora, seed=self.cfg.seed, algo=asdict(self.cfg.algo),
                            data=asdict(self.cfg.data), replay=self.cfg.replay)

    def save(self, step: int, history: list, evals: dict, **extra) -> None:
        from ..checkpoint.api import rng_state, save_checkpoint

        save_checkpoint(self.out / "checkpoints", step, self.policy.model, self.policy.optimizer,
                        run_meta=self.run_meta(), state={"step": step, "version": self.policy.version,
                                                         "rng": rng_state(), "history": history, "evals": evals,
                                                         "mode": self.cfg.mode, **extra})

    def resumes(self) -> bool:
        """resume=true, or resume=auto with a checkpoint to load (rank 0 looks; every rank learns). First, a
        checkpoint the previous start resumed from and failed on is recorded, never to be loaded again
        (checkpoint/attempts.py); resume=auto with checkpoints but none left to load is refused, not a fresh start."""
        from ..checkpoint.api import failed_steps, record_failed_resume, resumable_step

        root = self.out / "checkpoints"
        found = failed = None
        if self.rank == 0 and self.cfg.resume:
            failed = record_failed_resume(root)
            if failed is not None:
                print(f"checkpoint: the previous start failed after resuming from step {failed}: recorded in "
                      f"{root / 'failed_resumes.json'}, it is not loaded again", file=sys.stderr, flush=True)
            found = resumable_step(root)
            if found is None and failed_steps(root):
                found = -1                          # checkpoints exist, every one failed a restart: refused below
        if self.cfg.resume != "auto":
            return bool(self.cfg.resume)
        found = broadcast(found)
        if found == -1:
            raise ValueError(f"resume=auto: no checkpoint left to resume from in {root}: a restart failed on step(s) "
                             f"{', '.join(map(str, failed_steps(root)))} (recorded in {root / 'failed_resumes.json'})")
        return found is not None

    def resume(self) -> tuple[int, list, dict, dict]:
        """Load the latest checkpoint (before the engine starts: a refusal starts nothing); the engine then gets
        that adapter version. Returns (step, history, evals, the whole saved state)."""
        from ..checkpoint.api import load_checkpoint, mark_resuming, set_rng_state

        state = load_checkpoint(self.out / "checkpoints", self.policy.model, self.policy.optimizer,
                                run_meta=self.run_meta())
        if self.rank == 0:                          # cleared by the first step after it (stepped)
            mark_resuming(self.out / "checkpoints", state["step"])
        set_rng_state(state["rng"])
        self.policy.version = state["version"]
        return state["step"], state["history"], {int(k): v for k, v in state["evals"].items()}, state
