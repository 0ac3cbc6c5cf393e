"""Expert-layer and linear LoRA for megatron-core: config, sharding rule, layers, apply, grad sync, state."""
from .apply import apply_lora, plan_adapters, remove_lora
from .config import LoRAConfig
from .grad_sync import sync_adapter_grads
from .layers import adapter_factors
from .state import gather_adapters, load_sharded, save_sharded
from .toggle import adapters_disabled

__all__ = ["LoRAConfig", "apply_lora", "plan_adapters", "remove_lora", "sync_adapter_grads", "adapter_factors",
           "gather_adapters", "save_sharded", "load_sharded", "adapters_disabled"]
