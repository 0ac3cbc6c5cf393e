"""The RL run on top of the training core (policy/) and the rollout engine (rollout/): the synthetic task and its
scorer, verl-format data, the warm start, the run config schema (recipes/train.yaml), batch assembly, diagnostics,
metrics and the GRPO driver (run.py: one loop over a rollout source, source.py / async_source.py /
shared_sources.py; entry point moe_lora_rl/train.py). Nothing below rl/ imports it."""
