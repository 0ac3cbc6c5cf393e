"""Our rollout replica: verl's vLLM replica and HTTP server, with four hook overrides (verl's own override points):

    _init_model_config   hide model.lora from the vLLM arguments (verl turns vLLM's own LoRA on for any rank > 0;
                         our worker extension serves the expert adapters instead) and refuse conflicting options
    _init_config         eager mode (route capture needs the uncompiled forward); prefix caching as configured
    _get_worker_extension_cls   moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension (staged commit, capture)
    _resolve_sleep_level 1: base weights stay resident, only adapters are refitted after the first sync
"""
from __future__ import annotations

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from .config import check_rollout, lora_config

WORKER_EXTENSION = "moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension"


class MoELoRAvLLMHttpServer(vLLMHttpServer):
    def _init_config(self, config):
        cfg = super()._init_config(config)
        check_rollout(cfg)
        object.__setattr__(cfg, "enforce_eager", True)
        return cfg

    def _init_model_config(self, model_config):
        mc = super()._init_model_config(model_config)
        self.moe_lora = lora_config(mc.lora)            # our adapter config (refused here if it conflicts)
        object.__setattr__(mc, "lora", {})               # what verl's launch_server reads: no vLLM LoRA
        object.__setattr__(mc, "lora_rank", 0)
        return mc

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION

    def _resolve_sleep_level(self) -> int:
        return 1


class MoELoRAvLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(MoELoRAvLLMHttpServer)
