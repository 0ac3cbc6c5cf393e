"""The one way to build a vLLM engine for us: an offline `LLM` in this process with our worker extension.

    set_engine_env()            # in main(), before vLLM (and torch) are imported; never at import time
    llm = make_engine(model_dir, dtype="float32", prefix_caching=True, serving="unmerged")

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so collective_rpc reaches the worker
extension by reference: InprocTransport pushes and the routing capture use it.
"""
from __future__ import annotations

import os

from ..vllm import WORKER_EXTENSION
from ..vllm.compat import check_vllm_version

SERVING_MODES = ("unmerged", "merged")


def engine_env(threads: int | None = None) -> dict:
    """Environment of a process holding an in-process vLLM CPU engine (to be set before vLLM and torch are
    imported). OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep as soon as a parallel region ends instead of spinning,
    so an idle engine takes no CPU from a trainer sharing the cores."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",       # engine core in this process: collective_rpc by reference
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),    # GiB; vLLM's is for real models
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def set_engine_env(threads: int | None = None) -> None:
    """engine_env() into this process: call it first thing in a main(), so importing a module changes nothing."""
    os.environ.update(engine_env(threads))


def make_engine(model: str, *, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 512,
                prefix_caching: bool | None = None, serving: str | None = None, block_size: int | None = None,
                max_num_seqs: int | None = None, load_format: str = "auto", extension: str = WORKER_EXTENSION,
                stage_timeout_s: float | None = None, **llm_kw):
    """vLLM's `LLM` over `model`, eager (no graph capture: seconds to start on CPU), with `extension` as the worker
    extension (integration/verl passes its subclass). None: vLLM's default. serving: the expert-adapter serving
    mode the extension starts in (None: its default, unmerged; moe_lora_set_mode changes it later).
    stage_timeout_s: seconds without progress after which the extension aborts an open adapter stage (None: its
    default, vllm/staging.DEFAULT_STAGE_TIMEOUT_S). llm_kw: any other EngineArgs field, passed through."""
    check_vllm_version("make_engine")                   # before vLLM loads the model
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("make_engine needs the engine core in this process: call set_engine_env() in main() "
                           "before vLLM is imported")
    if serving is not None:
        if serving not in SERVING_MODES:
            raise ValueError(f"serving={serving!r}: expected one of {SERVING_MODES}")
        llm_kw["additional_config"] = {**llm_kw.get("additional_config", {}), "moe_lora_serving": serving}
    if stage_timeout_s is not None:
        from ..vllm.staged_push import check_stage_timeout

        llm_kw["additional_config"] = {**llm_kw.get("additional_config", {}),
                                       "moe_lora_stage_timeout_s": check_stage_timeout(stage_timeout_s)}
    from vllm import LLM
    from vllm.platforms import current_platform

    from ..vllm import vision_import_fix

    llm_kw = checkpoint_settings(model, llm_kw)
    prefix_caching = hybrid_prefix_caching(model, prefix_caching, llm_kw.get("enable_chunked_prefill"))
    with vision_import_fix.scoped(model, cpu=current_platform.is_cpu()):    # Qwen3.5 without torchvision
        llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=True,
                  enable_prefix_caching=prefix_caching, block_size=block_size, max_num_seqs=max_num_seqs,
                  load_format=load_format, worker_extension_cls=extension, **llm_kw)
    llm.collective_rpc("moe_lora_prepare")      # the fixes on the loaded model (vllm/rope_fix.py) before any request
    return llm


def checkpoint_settings(model: str, llm_kw: dict) -> dict:
    """llm_kw with what the checkpoint needs (vllm/mla_config.engine_args: DeepSeek-V3's routing keys where
    config.json lacks them, one line printed; the CPU MLA backend on a CPU engine), the caller's own values first;
    ValueError for MLA widths the CPU engine cannot decode, before the engine starts."""
    from vllm.platforms import current_platform

    from ..vllm.mla_config import engine_args

    out, lines = engine_args(model, llm_kw, cpu=current_platform.is_cpu())
    for line in lines:
        print(line, flush=True)
    return out


def hybrid_prefix_caching(model: str, requested: bool | None, chunked_prefill: bool | None) -> bool | None:
    """enable_prefix_caching for this checkpoint: off for a hybrid linear-attention one on an engine without chunked
    prefill, with one line saying why (vllm/hybrid_config.py); `requested` otherwise."""
    from ..vllm.hybrid_config import prefix_caching

    value, lines = prefix_caching(model, requested, chunked_prefill=chunked_prefill)
    for line in lines:
        print(line, flush=True)
    return value
