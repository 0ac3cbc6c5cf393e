"""What vLLM 0.32 needs from a DeepSeek-V3-architecture checkpoint (DeepSeek-V3/R1, Kimi-K2, Moonlight) before an
engine starts (pure: reads config.json, no vLLM import).

    routing keys   HF's DeepseekV3Config does not write `topk_method` / `scoring_func`, and HF's model ignores them
                   (it always scores with sigmoid + e_score_correction_bias, grouped top-k). vLLM reads them: without
                   topk_method it builds no expert bias and fails to load the checkpoint (KeyError
                   '...mlp.gate.e_score_correction_bias'); without scoring_func it scores with softmax. Missing keys
                   are given DeepSeek-V3's values through vLLM's hf_overrides, with one line saying so; values the
                   checkpoint sets are left as they are.
    latent widths  vLLM's CPU MLA decode kernel (csrc/cpu/mla_decode.cpp) runs only a 576-wide head over a 512-wide
                   latent: kv_lora_rank 512 with qk_rope_head_dim 64 (DeepSeek-V3's and Kimi-K2's own). Another width
                   starts, prefills and fails at the first decode step with "Unsupported block size: 16"; it is
                   refused here, before the engine starts.
    backend        on a CPU with AMX, vLLM prefers its AMX_MLA backend, which takes bf16 weights only (an fp32 engine
                   fails at load: "expect weight to be bfloat16, float16, ...") and packs its own copies of the
                   absorbed matrices. The CPU engine is pinned to CPU_MLA (any dtype; the decode kernel above), the
                   backend these rules and the serving of kv_b_proj adapters were measured on, unless the caller
                   chose a backend.

Both ways we start vLLM take these through engine_args(model_dir, kw, cpu=...): make_engine (rollout/vllm_engine.py) and
verl's rollout server (integration/verl/replica.py); the caller says whether the engine runs on CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
ROUTING_DEFAULTS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
CPU_DECODE_WIDTHS = ((512, 64),)            # (kv_lora_rank, qk_rope_head_dim) vLLM 0.32's CPU MLA decode kernel runs
CPU_BACKEND = "CPU_MLA"


def is_mla(config: dict) -> bool:
    return bool(set(config.get("architectures") or ()) & set(MLA_ARCHITECTURES)) and "kv_lora_rank" in config


def check_cpu_widths(config: dict) -> None:
    """ValueError naming the latent / rope widths unless vLLM's CPU MLA decode kernel runs them."""
    widths = (config.get("kv_lora_rank"), config.get("qk_rope_head_dim"))
    if widths not in CPU_DECODE_WIDTHS:
        accepted = " or ".join(f"kv_lora_rank {k} with qk_rope_head_dim {r}" for k, r in CPU_DECODE_WIDTHS)
        raise ValueError(f"MLA checkpoint with kv_lora_rank {widths[0]} and qk_rope_head_dim {widths[1]}: vLLM's CPU "
                         f"MLA decode kernel runs only {accepted} (DeepSeek-V3's and Kimi-K2's widths)")


def engine_settings(config: dict, *, cpu: bool) -> tuple[dict, dict, list[str]]:
    """(hf_overrides, other engine arguments, lines to print) for a checkpoint's config.json; ValueError for widths
    the CPU engine cannot decode (cpu=True). All empty for any other architecture."""
    if not is_mla(config):
        return {}, {}, []
    engine_kw = {}
    if cpu:
        check_cpu_widths(config)
        engine_kw["attention_backend"] = CPU_BACKEND
    missing = {k: v for k, v in ROUTING_DEFAULTS.items() if k not in config}
    if not missing:
        return {}, engine_kw, []
    said = ", ".join(f"{k}={v!r}" for k, v in missing.items())
    return missing, engine_kw, [f"moe_lora: config.json has no {' / '.join(missing)}; serving with DeepSeek-V3's "
                                f"{said} (what HF's DeepseekV3 model computes whatever they say)"]


def engine_settings_for(model_dir: str | Path, *, cpu: bool) -> tuple[dict, dict, list[str]]:
    """engine_settings of a checkpoint directory; empty when it has no config.json (vLLM reports that itself)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}, {}, []
    return engine_settings(json.loads(path.read_text()), cpu=cpu)


def engine_args(model_dir: str | Path, kw: dict, *, cpu: bool) -> tuple[dict, list[str]]:
    """(kw with what the checkpoint needs, lines to print): DeepSeek-V3's routing keys where config.json lacks them
    (in `hf_overrides`, beneath the caller's), the CPU MLA backend (cpu=True, unless kw chose a backend through
    `attention_backend` or `attention_config`); the caller's values win. ValueError for MLA widths the CPU engine
    cannot decode (cpu=True), before the engine starts. kw unchanged for any other architecture."""
    overrides, engine_kw, lines = engine_settings_for(model_dir, cpu=cpu)
    if "attention_config" in kw:
        engine_kw.pop("attention_backend", None)
    out = {**engine_kw, **kw}
    if overrides:
        out["hf_overrides"] = {**overrides, **(kw.get("hf_overrides") or {})}
    return out, lines
