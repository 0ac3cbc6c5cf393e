"""The moe_lora_rl vLLM plugin (entry point vllm.general_plugins: moe_lora_rl = moe_lora_rl.vllm:register).

register() runs in every vLLM process on the machine, including those of users who never asked for this plugin, so
it changes nothing. Everything we change in vLLM is applied by the worker extension
moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension (pass it as worker_extension_cls) on its first moe_lora_* call,
after checking the vLLM version it was written for (compat.check_vllm_version): on another version our calls fail
with that error and vLLM stays untouched. This package imports nothing from Megatron.

What it holds: the worker extension (worker_ext.py: adapter pushes, request versions, route capture; entry.py: the
first-call hook; base_entries.py: the base weights' entries), the staged-push state machine (staged_push.py), the
expert-LoRA runtime (runtime.py, token_groups.py: several versions per step; merge.py, mla_merge.py, moe_torch.py;
versions.py: the version table), route capture (capture.py, prefix_routes.py, step_hooks.py), the full-base sync
(base_sync.py, base_export.py: a peer's base; reload_txn.py), adapter validation (adapter_set.py), KV compression
(kv_select.py, kv_evict.py), what an MLA or hybrid checkpoint needs before an engine starts (mla_config.py,
hybrid_config.py), the vLLM fixes the extension applies (reload_fix.py, rope_fix.py, gdn_torch.py; compat.py: the
version check), the Qwen3.5 vision import fix (vision_import_fix.py) and the CPU worker class that enters it in a
spawned worker (cpu_worker.py).
"""

# the one spelling of the extension's class path (engines are built by moe_lora_rl.rollout.vllm_engine.make_engine)
WORKER_EXTENSION = "moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension"


def register() -> None:
    """Deliberately empty: see the module docstring."""
