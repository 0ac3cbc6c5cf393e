"""Layout-independent training checkpoints of a LoRA policy (adapters, their AdamW state, the run state): api.py is
the entry point (save_checkpoint, load_checkpoint, describe_run, rng state); save.py writes, load.py reads,
common.py holds what both share, attempts.py the failed-resume record; pure rules: directory.py (names, manifest
checks, candidates and cleanup, crash spec) and reshard_plan.py (the reads of another layout's slices)."""
