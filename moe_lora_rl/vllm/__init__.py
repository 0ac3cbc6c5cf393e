"""The moe_lora_rl vLLM plugin (entry point vllm.general_plugins: moe_lora_rl = moe_lora_rl.vllm:register).

register() runs in every vLLM process. It applies the CPU MoE reload fix. The adapter runtime (plain-torch expert
LoRA, adapter versions) is reached through the worker extension moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension
(pass it as worker_extension_cls). This package imports nothing from Megatron.
"""


def register() -> None:
    from . import reload_fix

    reload_fix.apply()
