"""The moe_lora_rl vLLM plugin (entry point vllm.general_plugins: moe_lora_rl = moe_lora_rl.vllm:register).

register() runs in every vLLM process on the machine, including those of users who never asked for this plugin, so
it changes nothing. Everything we change in vLLM is applied by the worker extension
moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension (pass it as worker_extension_cls) on its first moe_lora_* call,
after checking the vLLM version it was written for (compat.check_vllm_version): on another version our calls fail
with that error and vLLM stays untouched. This package imports nothing from Megatron.
"""

# the one spelling of the extension's class path (engines are built by moe_lora_rl.rollout.engine.make_engine)
WORKER_EXTENSION = "moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension"


def register() -> None:
    """Deliberately empty: see the module docstring."""
