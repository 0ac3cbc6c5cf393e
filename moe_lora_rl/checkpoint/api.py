"""Training checkpoints (the API; writer in save.py, reader in load.py, shared pieces in common.py, pure rules in
directory.py and reshard_plan.py) of a LoRA policy: sharded adapters, their AdamW state sharded the same way, and the caller's
run state (step, adapter version, data position, RNG states, scheduler), loadable at any other layout.

    save:  rank 0 tidies debris -> all ranks write into ROOT/.tmp-step-N/ and hash their files -> exchange success
           -> rank 0 writes manifest.json last and .latest.tmp -> (same step again: step-N -> .old-step-N) ->
           .tmp-step-N -> step-N -> .latest.tmp -> latest (the commit) -> .old-step-N removed -> share the verdict
    load:  latest -> manifest -> run identity and LoRA config -> sha256 of every file -> plan the reads of this
           rank's slices (reshard_plan.plan_reads) -> only when every rank found everything: copy into the model and
           the optimizer; an integrity error (missing, incomplete, corrupted) tries the next candidate

Crash consistency: a kill anywhere in a save leaves the previous complete checkpoint as the one loaded, until the
commit (new step: `latest` replaced; same step again: .tmp-step-N renamed to step-N). The load ignores .tmp-*, step
directories without manifest and newer steps than `latest` names; when that one is missing, incomplete or fails a
checksum it loads .old-step-N (a resave killed between its renames) or the newest older complete checkpoint, with one
line on stderr (rank 0), every rank choosing the same. Run identity and LoRA config mismatches are refusals, never a
fallback. The next save removes the debris (plan_cleanup) and puts an interrupted resave's old copy back. A write
error (disk full) is one OSError naming the file, raised on every rank together, with the .tmp removed.

Crash points (tests): MOE_LORA_RL_CKPT_CRASH=POINT[:exit|:raise][:rankR], read at each point; exit = os._exit(CRASH_EXIT)
(a kill), raise = RuntimeError (a write failure: shared and rolled back like one); rankR: on that global rank only.
    before_shards    .tmp-step-N made, nothing written
    between_shards   this rank's adapter file written, its optimizer file not
    after_shards     this rank's files written and hashed, before the ranks exchange success
    before_manifest  rank 0: lora_config.json and optimizer.json written, manifest.json not
    before_rename    rank 0: manifest.json and .latest.tmp written, nothing renamed
    mid_replace      rank 0, same step again only: step-N moved to .old-step-N, .tmp-step-N not yet renamed
    before_latest    rank 0: step-N in place, `latest` not replaced (a resave has committed here)
    before_cleanup   rank 0: `latest` replaced (committed), .old-step-N not yet removed

A refusal (a one-line ValueError naming the file and the mismatch, the same on every rank) changes neither the model,
the optimizer nor any file. Adam's moments have their parameter's shape and sharding, so they are stored as slices of
the global canonical tensor exactly like the adapters (lora/state.py's format: the step directory also loads with
lora.load_sharded).

Exact resume, in this order:
    meta = describe_run(model_path, lora, layout, seed=cfg.seed, algo=...)   # what must not change across a resume
    after step k (update, push, metrics logged): save_checkpoint(root, k, model, optimizer, run_meta=meta,
        state={"step": k, "version": policy.version, "rng": rng_state(), ...})
    on resume (resumable_step(root) is not None), after building the model and optimizer, before the first push:
        state = load_checkpoint(root, model, optimizer, run_meta=meta); set_rng_state(state["rng"])
        policy.version = state["version"]; (re)start the engine; push that version; continue with step k + 1
"""
from __future__ import annotations

import os  # noqa: F401 - tests patch os.rename through this module
import random
import torch

from ..lora.config import LoRAConfig
from .common import CRASH_EXIT, MOMENTS, OPTIMIZER_FILE, _crash_point  # noqa: F401 - the public surface
from .attempts import failed_steps, mark_resuming, record_failed_resume, resume_succeeded  # noqa: F401
from .load import check_resume_lora, load_checkpoint, resumable_step  # noqa: F401
from .common import latest_step  # noqa: F401
from .directory import sha256_file  # noqa: F401 - tests hash configs through this module
from .model_identity import model_identity
from .save import non_finite, prune, save_checkpoint  # noqa: F401





# ---- run identity and RNG state -------------------------------------------------------------------------------

def describe_run(model_path, lora: LoRAConfig, layout=None, **extra) -> dict:
    """run_meta for save/load: the model by content (model_identity.py: config and weights digests; its path is
    recorded, not checked), the LoRA config and the layout (recorded, not checked: a checkpoint loads at any
    layout). Extra keys must match exactly on load. ValueError: no config.json under model_path."""
    meta = {"model": model_identity(model_path), "lora": lora.to_dict()}
    if layout is not None:
        meta["layout"] = getattr(layout, "name", str(layout))
    return {**meta, **extra}


def rng_state() -> dict:
    """This process's python, numpy and torch RNG states (for `state`; restore with set_rng_state)."""
    import numpy as np

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(s: dict) -> None:
    import numpy as np

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])



