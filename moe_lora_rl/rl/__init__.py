"""The RL run on top of the training core (policy/), the rollout engine (rollout/) and the data and reward (data/):
the run config (config/: the schema of recipes/train.yaml and the preflight), what a run starts from (inputs.py),
batch assembly, diagnostics, metrics and the GRPO driver (run.py: one loop over a rollout source, source.py /
async_source.py / shared_sources.py; entry point moe_lora_rl/train.py). Nothing below rl/ imports it."""
