"""verl's own trainer config (ppo_megatron_trainer) composed with hydra and our overrides: what main_ppo would see."""
from __future__ import annotations

import os

ENGINE_TARGET = "moe_lora_rl.integration.verl.plugin.MoELoRAEngineConfig"


def our_overrides(model_path: str, *, tp=1, ep=1, etp=1, pp=1, rank=4, alpha=8, device="cuda",
                  dtype="bfloat16") -> dict:
    return {"actor_rollout_ref.actor.megatron._target_": ENGINE_TARGET,
            "actor_rollout_ref.model.external_lib": "moe_lora_rl.integration.verl.plugin",
            "actor_rollout_ref.model.path": model_path,
            "actor_rollout_ref.model.lora.rank": rank, "actor_rollout_ref.model.lora.alpha": alpha,
            "+actor_rollout_ref.model.lora.adapter_layout": "per_expert",
            "actor_rollout_ref.rollout.name": "moe_lora_vllm",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": tp,
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size": ep,
            "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": etp,
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": pp,
            "actor_rollout_ref.actor.megatron.dtype": dtype, "+actor_rollout_ref.actor.megatron.device": device,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}


def compose(overrides: dict):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        return hydra_compose("ppo_megatron_trainer",
                             overrides=[f"{k}={v}" for k, v in overrides.items() if v is not None])
