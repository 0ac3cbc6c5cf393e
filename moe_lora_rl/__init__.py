"""moe_lora_rl: expert-layer LoRA, LoRA-only refit and router replay for MoE RL on Megatron-core and vLLM."""

__version__ = "0.1.0"
