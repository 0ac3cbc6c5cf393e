"""The composition root of our verl override: the one module that registers anything with verl. verl imports it by
the names the recipe sets, and importing it registers (that is verl's plugin mechanism; no other module of ours
registers at import):

    actor_rollout_ref.model.external_lib                         = moe_lora_rl.integration.verl.plugin
    actor_rollout_ref.actor.megatron._target_                    = moe_lora_rl.integration.verl.plugin.MoELoRAEngineConfig
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module = moe_lora_rl.integration.verl.plugin
    VERL_USE_EXTERNAL_MODULES (Ray workers, CPU platform only)   = moe_lora_rl.integration.verl.plugin

It only adds names, so verl behaves as before unless the config selects them:

    PlatformRegistry            "moe_lora_cpu" (used only when VERL_PLATFORM names it; never auto-detected)
    EngineRegistry              ("language_model", "moe_lora", cuda|cpu) -> engine.MoELoRAEngine
    RolloutReplicaRegistry      "moe_lora_vllm" -> replica.MoELoRAvLLMReplica (loaded lazily, imports vLLM)
    rollout ServerAdapter       ("moe_lora_vllm", "async") -> verl's vLLM ServerAdapter (the worker side)
    CheckpointEngineRegistry    "moe_lora" -> checkpoint_engine.MoELoRACheckpointEngine
                                "moe_lora_base" -> checkpoint_engine.MoELoRABaseCheckpointEngine
    advantage estimators        "grpo_exact" -> algos.grpo_outcome_advantage (verl's GRPO; equal-reward groups
                                exactly 0: algorithm.adv_estimator=grpo_exact)
"""
from __future__ import annotations

from .verl_config import BACKEND, REPLICA, MoELoRAEngineConfig, check_verl_version

__all__ = ["MoELoRAEngineConfig", "register"]


def _load_replica():
    from .replica import MoELoRAvLLMReplica

    return MoELoRAvLLMReplica


def register() -> None:
    """Add our names to verl's registries (idempotent: a second call changes nothing)."""
    check_verl_version()
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from .platform_cpu import NAME, CPUPlatform

    if PlatformRegistry.get(NAME) is not CPUPlatform:
        PlatformRegistry.register(platform=NAME)(CPUPlatform)      # first: verl's engine modules read the platform
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .checkpoint_engine import (BACKEND as CKPT_BACKEND, BASE_BACKEND, MoELoRABaseCheckpointEngine,
                                    MoELoRACheckpointEngine)
    from .engine import MoELoRAEngine

    engines = EngineRegistry._engines.get("language_model", {}).get(BACKEND, {})
    if engines.get("cuda") is not MoELoRAEngine:
        EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])(MoELoRAEngine)
    RolloutReplicaRegistry.register(REPLICA, _load_replica)
    for name, cls in ((CKPT_BACKEND, MoELoRACheckpointEngine), (BASE_BACKEND, MoELoRABaseCheckpointEngine)):
        if CheckpointEngineRegistry._registry.get(name) is not cls:
            CheckpointEngineRegistry.register(name)(cls)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

    from ...algos import GRPO_EXACT, grpo_outcome_advantage

    if ADV_ESTIMATOR_REGISTRY.get(GRPO_EXACT) is not grpo_outcome_advantage:
        register_adv_est(GRPO_EXACT)(grpo_outcome_advantage)
    rollout_base._ROLLOUT_REGISTRY[(REPLICA, "async")] = rollout_base._ROLLOUT_REGISTRY[("vllm", "async")]


register()
