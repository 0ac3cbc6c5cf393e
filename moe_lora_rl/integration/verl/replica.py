"""Our rollout replica: verl's vLLM replica and HTTP server, with these hook overrides (verl's own override points):

    _init_model_config   hide model.lora from the vLLM arguments (verl turns vLLM's own LoRA on for any rank > 0;
                         our worker extension serves the expert adapters instead) and refuse conflicting options
    _init_config         eager mode (route capture needs the uncompiled forward); prefix caching as configured;
                         load_format=dummy becomes auto unless the sync is colocated ("naive"): our checkpoint-engine
                         backend carries adapters only, so there the server reads the (never trained) base itself
    _get_worker_extension_cls   integration.verl.vllm_extension.VerlMoELoRAWorkerExtension (staged commit, capture, and
                         verl's colocated update_weights_from_ipc)
    _resolve_sleep_level 1: base weights stay resident, only adapters are refitted after the first sync
    _preprocess_engine_kwargs   what the checkpoint needs, as make_engine gives it (vllm/mla_config.engine_args):
    _apply_quantization  for MLA, DeepSeek-V3's routing keys where config.json lacks them (one line) in verl's
                         hf_overrides, the CPU MLA attention backend on a CPU engine, widths the CPU engine cannot
                         decode refused before it starts; for Qwen3.5 on a CPU without torchvision our CPU worker
                         class (vllm/vision_import_fix.py: the workers load the model in processes of their own);
                         for a hybrid checkpoint without chunked prefill, prefix caching off (vllm/hybrid_config.py);
                         engine_kwargs.vllm's own values win. The model fixes (vllm/rope_fix.py, vllm/gdn_torch.py)
                         come with our worker extension: verl's monkey_patch_model call is its first
    generate             with rollout.enable_rollout_routing_replay: verl's TokenOutput.routed_experts filled from our
                         capture (server_routes.py); vLLM's own routed-experts return is never turned on
    run_server           the engine wrapped so verl's pause call reaches vLLM 0.32 (engine_compat.py); built inside
                         vision_import_fix.scoped (Qwen3.5's inspection without torchvision, CPU only)
    clear_kv_cache       (what verl's ServerAdapter calls after each weight sync) with engine_kwargs.moe_lora.sync_log:
    open_submission_gate the served version and a probe's log-probs recorded (sync_probe.py) once the engine runs
                         (verl's async trainers pause it for the sync and reopen the gate after)
    _get_server_name_prefix (replica) "<rollout.name>_": the name verl's ServerAdapter looks the server actor up by
                         (verl's replica answers "vllm_", which only matches rollout.name=vllm)
kv_b_proj adapters are merged and re-derived at each commit by our worker extension's runtime (vllm/mla_merge.py).
"""
from __future__ import annotations

from verl.utils.tokenizer import normalize_token_ids
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from ...vllm import vision_import_fix
from ...vllm.compat import check_vllm_version
from .verl_config import WORKER_EXTENSION, check_rollout, lora_config, rollout_load_format
from .engine_compat import PauseCompat, needs_pause_compat
from .server_routes import ServerRoutes
from .sync_probe import record_served, sync_settings


def checkpoint_engine_args(model_dir: str, engine_kwargs: dict, rollout, *, cpu: bool) -> tuple[dict, list[str]]:
    """(engine_kwargs with what the checkpoint needs, lines to print), as make_engine gives it to our own engine:
    vllm/mla_config.engine_args (MLA), vllm/vision_import_fix.engine_args (Qwen3.5 on a CPU without torchvision: our
    CPU worker class) and vllm/hybrid_config.prefix_caching (a hybrid checkpoint without chunked prefill: prefix
    caching off); engine_kwargs' own values win, `rollout` (verl's rollout config) gives the rest."""
    from ...vllm.hybrid_config import prefix_caching
    from ...vllm.mla_config import engine_args

    args, lines = engine_args(model_dir, engine_kwargs, cpu=cpu)
    args, more = vision_import_fix.engine_args(model_dir, args, cpu=cpu)
    caching, said = prefix_caching(model_dir, args.get("enable_prefix_caching", rollout.enable_prefix_caching),
                                   chunked_prefill=args.get("enable_chunked_prefill", rollout.enable_chunked_prefill))
    if said:
        args["enable_prefix_caching"] = caching
    return args, lines + more + said


class MoELoRAvLLMHttpServer(vLLMHttpServer):
    def _init_config(self, config):
        cfg = super()._init_config(config)
        check_rollout(cfg)
        object.__setattr__(cfg, "enforce_eager", True)
        object.__setattr__(cfg, "load_format", rollout_load_format(cfg))
        # R3 from our capture: verl's server would turn on vLLM's routed-experts return and read it back
        self.moe_routes = ServerRoutes() if cfg.enable_rollout_routing_replay else None
        object.__setattr__(cfg, "enable_rollout_routing_replay", False)
        return cfg

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        if self.moe_routes is None:
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        await self.moe_routes.start(self.engine)
        n_prompt = len(normalize_token_ids(prompt_ids))
        try:
            out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        except BaseException:
            await self.moe_routes.discard(self.engine, request_id)
            raise
        if out.stop_reason == "aborted" or not out.token_ids:
            await self.moe_routes.discard(self.engine, request_id)          # no routes for a partial response
            return out
        out.routed_experts = await self.moe_routes.pop(self.engine, request_id, n_prompt + len(out.token_ids) - 1)
        return out

    async def run_server(self, args):
        from vllm.platforms import current_platform

        # the architecture is inspected here as the engine is built (Qwen3.5 without torchvision: the fix's in-process
        # inspection); the workers take the same fix through worker_cls (checkpoint_engine_args)
        with vision_import_fix.scoped(self.model_config.local_path, cpu=current_platform.is_cpu()):
            await super().run_server(args)          # sets self.engine, then serves
        if needs_pause_compat(self.engine):
            self.engine = PauseCompat(self.engine)

    async def clear_kv_cache(self):
        await super().clear_kv_cache()
        if self.node_rank == 0 and sync_settings(self.config)[0]:
            self.moe_sync_pending = True
            if not await self.engine.is_paused():     # async trainers resume the engine after the sync: probe then
                await self._record_sync()

    async def open_submission_gate(self):
        await super().open_submission_gate()      # the replica's resume: engine resumed, then the gate opens
        if getattr(self, "moe_sync_pending", False):
            await self._record_sync()

    async def _record_sync(self):
        self.moe_sync_pending = False
        await record_served(self)

    def _init_model_config(self, model_config):
        mc = super()._init_model_config(model_config)
        self.moe_lora = lora_config(mc.lora)            # our adapter config (refused here if it conflicts)
        object.__setattr__(mc, "lora", {})               # what verl's launch_server reads: no vLLM LoRA
        object.__setattr__(mc, "lora_rank", 0)
        return mc

    def _preprocess_engine_kwargs(self, engine_kwargs: dict) -> None:
        super()._preprocess_engine_kwargs(engine_kwargs)
        from vllm.platforms import current_platform

        args, lines = checkpoint_engine_args(self.model_config.local_path, engine_kwargs, self.config,
                                             cpu=current_platform.is_cpu())
        for line in lines:
            print(line, flush=True)
        # verl builds hf_overrides in _apply_quantization and spreads engine_kwargs after it: ours go there, unless
        # engine_kwargs names hf_overrides itself (then engine_args put ours beneath those)
        self.moe_hf_overrides = {} if "hf_overrides" in engine_kwargs else args.pop("hf_overrides", {})
        engine_kwargs.update(args)

    def _apply_quantization(self):
        quantization, hf_overrides = super()._apply_quantization()
        return quantization, {**getattr(self, "moe_hf_overrides", {}), **hf_overrides}

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION

    def _resolve_sleep_level(self) -> int:
        return 1


class MoELoRAvLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        check_vllm_version("the moe_lora_vllm rollout")   # before verl starts any server actor
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(MoELoRAvLLMHttpServer)

    def _get_server_name_prefix(self) -> str:
        return f"{self.config.name}_"       # what verl's ServerAdapter._get_server_name_prefix derives
