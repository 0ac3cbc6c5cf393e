"""The RL run on top of the training core (policy/) and the rollout engine (rollout/): the synthetic task and its
scorer, verl-format data, the warm start, the run config schema (recipes/train.yaml), batch assembly, diagnostics,
metrics and the GRPO driver (run.py; entry point moe_lora_rl/train.py). Nothing below rl/ imports it."""
