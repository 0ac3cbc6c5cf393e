"""Every vLLM, verl and megatron-core symbol moe_lora_rl relies on: derived from our source, plus one table of hooks.

    derived(root)     every `from vllm|verl|megatron... import X` / `import ...` in moe_lora_rl/ (module + name),
                      and every member our subclasses of an imported upstream class define (overrides: the report
                      keeps those the baseline's class has, so the override's signature is compared)
    HOOKS             what no import shows: members we wrap, read or set on upstream objects, keywords we pass
                      (patches/README.md says why for each); a row that the baseline lacks is a mistake in this
                      table (tests/unit/test_upstream_api.py checks it against the installed versions)
    symbols(root, baselines)   both, deduplicated, overrides filtered by the baselines

Read by moe_lora_rl.upstream.report (python -m moe_lora_rl.upstream.report).
"""
from __future__ import annotations

import ast
from pathlib import Path

from .lookups import PRESENT, PackageSource, Symbol, lookup

PACKAGES = ("vllm", "verl", "megatron")

_VLLM_WORKER = "vllm.v1.worker.gpu_worker"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_FUSED = "vllm.model_executor.layers.fused_moe"

# (module, qualname, params, why, where): members reached through objects, keyword arguments we pass
HOOK_ROWS = [
    # vLLM: the fixes the worker extension applies (vllm/reload_fix.py, rope_fix.py, mla_merge.py)
    (f"{_FUSED}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod._setup_kernel", ("layer", "w13", "w2"),
     "wrapped (CPU reload prepack)", "vllm/reload_fix.py"),
    (f"{_FUSED}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod.moe_kernel", (), "read", "vllm/reload_fix.py"),
    (f"{_FUSED}.modular_kernel", "FusedMoEKernel.fused_experts", (), "read", "vllm/reload_fix.py"),
    (f"{_FUSED}.modular_kernel", "FusedMoEExperts.process_weights_after_loading", ("layer",), "called",
     "vllm/reload_fix.py, merge.py"),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding.forward_cpu", (), "dispatch compared",
     "vllm/rope_fix.py"),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding.forward_native",
     ("positions", "query", "key"), "called", "vllm/rope_fix.py"),
    ("vllm.model_executor.custom_op", "CustomOp._forward_method", (), "set per instance", "vllm/rope_fix.py"),
    ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.rotary_emb", (), "read", "vllm/rope_fix.py"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.kv_b_proj", (), "weight overwritten",
     "vllm/mla_merge.py"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.process_weights_after_loading",
     ("act_dtype",), "called again", "vllm/mla_merge.py"),
    # vLLM: the worker and its model runner (worker extension, step hooks, capture, prefix routes)
    (_VLLM_WORKER, "Worker.model_runner", (), "read", "vllm/worker_ext.py"),
    (_VLLM_WORKER, "Worker.model_config", (), "read", "vllm/worker_ext.py"),
    (_VLLM_WORKER, "Worker.vllm_config", (), "read", "vllm/base_sync.py"),
    (_VLLM_WORKER, "Worker.device", (), "read", "vllm/base_sync.py"),
    (_VLLM_WORKER, "Worker.weight_transfer_engine", (), "set", "vllm/base_sync.py"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", (), "the CPU worker", "integration/verl/platform_cpu.py"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", (), "the CPU runner", "vllm/step_hooks.py"),
    (_RUNNER, "GPUModelRunner._model_forward", (), "wrapped per instance", "vllm/step_hooks.py"),
    (_RUNNER, "GPUModelRunner.input_batch", (), "read", "vllm/step_hooks.py"),
    (_RUNNER, "GPUModelRunner.query_start_loc", (), "read", "vllm/step_hooks.py"),
    (_RUNNER, "GPUModelRunner.requests", (), "read", "vllm/prefix_routes.py"),
    (_RUNNER, "GPUModelRunner.model", (), "read", "vllm/worker_ext.py"),
    (_RUNNER, "GPUModelRunner.get_model", (), "called", "vllm/base_sync.py"),
    (_RUNNER, "GPUModelRunner.vllm_config", (), "read", "vllm/capture.py"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", (), "read", "vllm/step_hooks.py"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", (), "read", "vllm/step_hooks.py"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_computed_tokens_cpu", (), "read", "vllm/step_hooks.py"),
    (f"{_FUSED}.router.base_router", "BaseRouter.set_capture_fn", ("capture_fn",), "called", "vllm/capture.py"),
    (f"{_FUSED}.router.base_router", "BaseRouter.global_num_experts", (), "read", "vllm/capture.py"),
    (f"{_FUSED}.router.base_router", "BaseRouter.top_k", (), "read", "vllm/capture.py"),
    # vLLM: KV eviction (vllm/kv_evict.py) and the engine core it reaches
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward", (), "wrapped per instance",
     "vllm/kv_evict.py"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.sliding_window", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.alibi_slopes", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.logits_soft_cap", (), "read",
     "vllm/kv_evict.py"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.sinks", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager._remove_blocks_in_range", (),
     "called", "vllm/kv_evict.py"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.kv_cache_manager", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.coordinator", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.enable_caching", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.single_type_managers", (), "read",
     "vllm/kv_evict.py"),
    ("vllm.v1.engine.core", "EngineCore.scheduler", (), "read", "vllm/kv_evict.py, rollout/loop.py"),
    ("vllm.v1.engine.core", "EngineCore.model_executor", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.engine.core", "EngineCore.async_scheduling", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.engine.core_client", "InprocClient.engine_core", (), "read", "vllm/kv_evict.py, rollout/kv_meter.py"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.engine_core", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.add_request", (), "called", "rollout/loop.py"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor.driver_worker", (), "read", "vllm/kv_evict.py"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase.worker", (), "read", "vllm/kv_evict.py"),
    # vLLM: engines we build and the keywords we pass (rollout/vllm_engine.py, rollout/server.py, vllm/mla_config.py)
    ("vllm.entrypoints.llm", "LLM.llm_engine", (), "read", "rollout/vllm_engine.py"),
    ("vllm.entrypoints.llm", "LLM.collective_rpc", ("method", "args", "kwargs"), "called", "rollout/loop.py"),
    *[("vllm.engine.arg_utils", f"EngineArgs.{k}", (), "keyword passed", "rollout/vllm_engine.py, vllm/mla_config.py")
      for k in ("model", "dtype", "seed", "max_model_len", "enforce_eager", "enable_prefix_caching", "block_size",
                "max_num_seqs", "load_format", "worker_extension_cls", "additional_config", "hf_overrides",
                "attention_backend")],
    ("vllm.v1.engine.async_llm", "AsyncLLM.pause_generation", ("clear_cache",), "called by verl",
     "integration/verl/engine_compat.py"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", ("method", "args"), "called",
     "integration/verl/server_routes.py"),
    *[("vllm.sampling_params", f"SamplingParams.{k}", (), "keyword passed", "rollout/server.py")
      for k in ("max_tokens", "temperature", "logprobs", "prompt_logprobs", "seed", "stop_token_ids", "detokenize",
                "output_kind")],
    ("vllm.platforms.interface", "Platform.is_cpu", (), "called", "rollout/vllm_engine.py"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine", (), "called",
     "vllm/base_sync.py"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.create_engine", (), "called",
     "vllm/base_sync.py"),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory._registry", (), "read",
     "vllm/base_sync.py"),
    ("vllm.config.weight_transfer", "WeightTransferConfig.backend", (), "keyword passed", "vllm/base_sync.py"),
    # verl 0.9.1: registries we add to, members we reach
    ("verl.workers.engine.base", "EngineRegistry.register", (), "called", "integration/verl/plugin.py"),
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry.register", (), "called", "integration/verl/plugin.py"),
    ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", (), "set", "integration/verl/plugin.py"),
    ("verl.checkpoint_engine.base", "CheckpointEngineRegistry.register", (), "called", "integration/verl/plugin.py"),
    ("verl.plugin.platform.platform_manager", "PlatformRegistry.register", (), "called",
     "integration/verl/plugin.py"),
    ("verl.trainer.main_ppo_v0", "BaseTaskRunner.add_actor_rollout_worker", (), "overridden",
     "integration/verl/task_runner.py"),
    # megatron-core: the CPU support's patched names and the hook points we set (patches/README.md)
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm", (), "set to None", "megatron/cpu_support.py"),
    ("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", (), "replaced",
     "megatron/cpu_support.py"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", (), "replaced",
     "megatron/cpu_support.py"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", (), "replaced", "megatron/cpu_support.py"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", (), "replaced",
     "megatron/cpu_support.py"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", (), "replaced", "megatron/cpu_support.py"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork", (), "replaced", "megatron/cpu_support.py"),
    ("megatron.core.transformer.multi_latent_attention", "HAVE_TE", (), "set to False", "megatron/cpu_support.py"),
    ("megatron.core.transformer.moe.router", "TopKRouter.router_replay", (), "set per instance",
     "router_replay/replayer.py"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.dispatch_preprocess",
     ("hidden_states", "routing_map", "probs"), "wrapped per instance (checks)", "checks/dispatch_capture.py"),
]
HOOKS = [Symbol(m, q, tuple(p), why, where) for m, q, p, why, where in HOOK_ROWS]


def _upstream(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PACKAGES


def _file_symbols(path: Path, rel: str) -> tuple[list[Symbol], list[Symbol]]:
    """(imports, overrides) of one of our files."""
    tree = ast.parse(path.read_text())
    imports, bound = [], {}                                  # local name -> (module, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and _upstream(node.module):
            for al in node.names:
                imports.append(Symbol(node.module, al.name, why="imported", where=f"{rel}:{node.lineno}"))
                bound[al.asname or al.name] = (node.module, al.name)
        elif isinstance(node, ast.Import):
            for al in node.names:
                if _upstream(al.name):
                    imports.append(Symbol(al.name, why="imported", where=f"{rel}:{node.lineno}"))
    overrides = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            if not (isinstance(base, ast.Name) and base.id in bound):
                continue
            mod, name = bound[base.id]
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members = [item.name]
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    members = [t.id for t in targets if isinstance(t, ast.Name)]
                else:
                    members = []
                overrides += [Symbol(mod, f"{name}.{m}", why=f"overridden by {node.name}",
                                     where=f"{rel}:{item.lineno}") for m in members]
    return imports, overrides


def derived(root: str | Path) -> tuple[list[Symbol], list[Symbol]]:
    """(imports, override candidates) of every .py file under `root` (the moe_lora_rl package folder), and in a
    checkout of the test kit beside it (tests/kit: test-only code outside the package uses upstream symbols too)."""
    root = Path(root)
    kit = root.parent / "tests" / "kit"
    files = [(p, str(p.relative_to(root))) for p in sorted(root.rglob("*.py"))]
    if kit.is_dir():
        files += [(p, str(p.relative_to(root.parent))) for p in sorted(kit.rglob("*.py"))]
    imports, overrides = [], []
    for path, rel in files:
        i, o = _file_symbols(path, rel)
        imports += i
        overrides += o
    return imports, overrides


def symbols(root: str | Path, baselines: dict[str, PackageSource]) -> list[Symbol]:
    """Imports, the overrides whose member the baseline's upstream class has, and HOOKS; one row per
    (module, qualname), the first use kept, sorted by package then module."""
    imports, overrides = derived(root)
    kept = [s for s in overrides if s.package in baselines and lookup(baselines[s.package], s).state == PRESENT]
    out: dict[tuple[str, str], Symbol] = {}
    for s in imports + kept + HOOKS:
        key = (s.module, s.qualname)
        if key not in out or (s.params and not out[key].params):
            out[key] = s
    return sorted(out.values(), key=lambda s: (PACKAGES.index(s.package), s.module, s.qualname))
