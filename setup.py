from setuptools import find_packages, setup

setup(
    name="moe_lora_rl",
    version="0.1.0",
    description="Expert-layer LoRA, LoRA-only refit and router replay for MoE RL with Megatron-core and vLLM",
    packages=find_packages(include=["moe_lora_rl", "moe_lora_rl.*"]),
    python_requires=">=3.11",
    entry_points={"vllm.general_plugins": ["moe_lora_rl = moe_lora_rl.vllm:register"],
                  "console_scripts": ["moe-lora-rl = moe_lora_rl.cli:console"]},
)
