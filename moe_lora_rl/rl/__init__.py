"""RL pieces that do not depend on Megatron or vLLM: the synthetic task, its scorer, the run config schema."""
