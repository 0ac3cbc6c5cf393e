"""Registration with verl's registries, run when verl imports this package as actor_rollout_ref.model.external_lib
(see __init__). It only adds names: verl behaves as before unless the config selects them.

    EngineRegistry              ("language_model", "moe_lora", cuda|cpu) -> engine.MoELoRAEngine
    RolloutReplicaRegistry      "moe_lora_vllm" -> replica.MoELoRAvLLMReplica (loaded lazily, imports vLLM)
    rollout ServerAdapter       ("moe_lora_vllm", "async") -> verl's vLLM ServerAdapter (the worker side)
    CheckpointEngineRegistry    "moe_lora" -> checkpoint_engine.MoELoRACheckpointEngine
    PlatformRegistry            "moe_lora_cpu" (only when VERL_PLATFORM names it; never auto-detected)
"""
from __future__ import annotations

_done = False


def _load_replica():
    from .replica import MoELoRAvLLMReplica

    return MoELoRAvLLMReplica


def register() -> None:
    global _done
    if _done:
        return
    _done = True                 # set first: importing config below calls register() again
    try:
        _register()
    except BaseException:
        _done = False
        raise


def _register() -> None:
    from .config import BACKEND, REPLICA, check_verl_version

    check_verl_version()
    from . import platform_cpu  # noqa: F401  first: verl's engine modules read the platform at import
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .engine import MoELoRAEngine

    engines = EngineRegistry._engines.get("language_model", {}).get(BACKEND, {})
    if engines.get("cuda") is not MoELoRAEngine:
        EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])(MoELoRAEngine)
    RolloutReplicaRegistry.register(REPLICA, _load_replica)
    from . import checkpoint_engine  # noqa: F401  (registers the "moe_lora" checkpoint-engine backend)
    rollout_base._ROLLOUT_REGISTRY[(REPLICA, "async")] = rollout_base._ROLLOUT_REGISTRY[("vllm", "async")]
