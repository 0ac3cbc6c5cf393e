"""Tiny and medium MoE checkpoints in HF format, made locally, deterministic from a seed, cached on disk.

    path = get_model("qwen3_moe", "tiny")     # Qwen3-MoE: every layer MoE, softmax top-k
    path = get_model("glm4_moe", "tiny")      # DeepSeek-V3/Kimi-K2 routing on GQA attention (GLM-4.5 architecture):
                                              # leading dense layer, shared expert, sigmoid scores + expert bias,
                                              # group-limited top-k, routed scaling factor
    path = get_model("qwen3_5_moe", "tiny")   # Qwen3.5/3.6-MoE: Gated DeltaNet and gated attention layers, every layer
                                              # MoE with a gated shared expert; tiny_vl: the released layout
                                              # (Qwen3_5MoeForConditionalGeneration: a vision tower, MTP layers);
                                              # get_model("qwen3_next", "tiny"): Qwen3-Next (tiny_hybrid.py)
    path = get_model("deepseek_v3", "tiny")   # DeepSeek-V3/Kimi-K2/Moonlight (DeepseekV3ForCausalLM): that routing on
                                              # Multi-head Latent Attention; sizes tiny (q_lora_rank set, yarn as
                                              # Kimi-K2), tiny_rope (plain RoPE, DeepSeek-V3's MTP layer in the
                                              # checkpoint), tiny_lite (q_lora_rank null, as Moonlight), wide

Weights are drawn per tensor from a generator seeded by (seed, tensor name), so they do not depend on the order in
which transformers initialises modules. The cache key hashes the spec, the seed and GENERATOR_VERSION.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

GENERATOR_VERSION = 1

_COMMON = dict(vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
               hidden_act="silu", attention_dropout=0.0, eos_token_id=2, pad_token_id=0, bos_token_id=None)

SPECS: dict[tuple[str, str], dict] = {
    ("qwen3_moe", "tiny"): dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ("glm4_moe", "tiny"): dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=128, intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        moe_intermediate_size=32, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=False, num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("glm4_moe", "small"): dict(      # the former RL default: learns the synthetic task in minutes on 2 CPU cores
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        moe_intermediate_size=128, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=False, num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("qwen3_moe", "medium"): dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ("glm4_moe", "medium"): dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, n_routed_experts=32,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        moe_intermediate_size=384, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
        use_qk_norm=False, num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}
SPECS[("glm4_moe", "wide")] = {    # the RL default: 128 fine-grained experts, top-8 in 4 of 8 groups (DeepSeek-V3's
    **SPECS[("glm4_moe", "small")],  # routing at a small scale); as many active routed parameters per token as small
    "n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "moe_intermediate_size": 64}
SPECS[("qwen3_moe", "wide")] = {   # glm4_moe wide's widths and expert count on Qwen3-MoE (softmax top-8 of 128, every
    **SPECS[("qwen3_moe", "tiny")],  # layer MoE, q/k norms): the verl user's Qwen3-30B-A3B script learns on it
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "head_dim": 64, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 64}
# DeepseekV3ForCausalLM. vLLM's CPU MLA decode kernel takes only kv_lora_rank 512 and qk_rope_head_dim 64 (a 576-wide
# head), so every spec uses those; qk_nope/v head dims and q_lora_rank are free. HF's config class does not write
# topk_method / scoring_func, which vLLM needs: MLA_CONFIG_EXTRA is written into config.json after saving.
KIMI_K2_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
MLA_CONFIG_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
_MLA = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256, intermediate_size=512,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16, n_shared_experts=1,
    num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, moe_intermediate_size=32,
    first_k_dense_replace=1, norm_topk_prob=True, attention_bias=False, rope_interleave=True,
    num_nextn_predict_layers=0, max_position_embeddings=131072, rope_parameters=KIMI_K2_YARN)
SPECS[("deepseek_v3", "tiny")] = _MLA                                        # Kimi-K2: yarn, no MTP layer
SPECS[("deepseek_v3", "tiny_rope")] = {**_MLA, "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
SPECS[("deepseek_v3", "tiny_lite")] = {**_MLA, "q_lora_rank": None, "max_position_embeddings": 8192,  # Moonlight:
                                       "n_group": 1, "topk_group": 1,                      # ungrouped top-k
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}
SPECS[("deepseek_v3", "wide")] = {   # glm4_moe wide's routing and widths on MLA
    **_MLA, "intermediate_size": 512, "n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "moe_intermediate_size": 64}
from . import tiny_hybrid  # noqa: E402  (Qwen3.5-MoE / Qwen3-Next: hybrid linear attention)

SPECS.update(tiny_hybrid.HYBRID_SPECS)
FAMILIES = sorted({f for f, _ in SPECS})
SIZES = ("tiny", "tiny_rope", "tiny_lite", "tiny_vl", "small", "wide", "medium")
_DTYPE = {"tiny": "float32", "tiny_rope": "float32", "tiny_lite": "float32", "tiny_vl": "float32", "small": "float32",
          "wide": "float32", "medium": "bfloat16"}


def check_routing(family: str, size: str, spec: dict) -> None:
    """The routing of a spec is one the model and the Megatron builder can run: experts split evenly into groups,
    topk_group groups of n_group, top-k within the experts those groups hold. ValueError naming the value."""
    experts = spec.get("n_routed_experts", spec.get("num_experts"))
    topk = spec["num_experts_per_tok"]
    groups, topk_group = spec.get("n_group", 1) or 1, spec.get("topk_group", 1) or 1
    where = f"model {family!r}/{size!r}"
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{where}: routed experts={experts!r} must be a positive integer")
    if experts % groups:
        raise ValueError(f"{where}: n_group={groups} does not divide the {experts} routed experts")
    if not 1 <= topk_group <= groups:
        raise ValueError(f"{where}: topk_group={topk_group} must be in 1..n_group={groups}")
    if not 1 <= topk <= topk_group * (experts // groups):
        raise ValueError(f"{where}: num_experts_per_tok={topk} is more than the {topk_group} of {groups} groups "
                         f"allow ({topk_group} x {experts // groups} experts)")
    if family in ("glm4_moe", "deepseek_v3") and groups > 1 and topk != 2 * topk_group:
        raise ValueError(f"{where}: num_experts_per_tok={topk} with topk_group={topk_group}: HF scores a group by its "
                         "top-2 experts, megatron-core by its top (top-k // topk_group), so they agree only when "
                         "top-k == 2 * topk_group")


def cache_root() -> Path:
    return Path(os.environ.get("MOE_LORA_RL_CACHE", Path.home() / ".cache" / "moe_lora_rl")) / "models"


def spec_key(family: str, size: str, seed: int) -> str:
    key = {"spec": SPECS[(family, size)], "seed": seed, "v": GENERATOR_VERSION}
    if family in tiny_hybrid.FAMILIES:
        key["init"] = tiny_hybrid.INIT_VERSION
    blob = json.dumps(key, sort_keys=True)
    return f"{family}-{size}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def _init_value(name: str, shape: torch.Size, seed: int, hidden: int, zero_centered: bool = False) -> torch.Tensor:
    """zero_centered: the family's RMSNorms compute x * (1 + w) (the hybrid family's, except the delta-net's gated
    norm linear_attn.norm)."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:15], 16))
    if zero_centered and (name.endswith("norm.weight") or ".q_norm." in name or ".k_norm." in name) \
            and not name.endswith("linear_attn.norm.weight"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith(".A_log"):                                  # decay rates exp(A_log) in [1, 16], as initialised
        return (1.0 + 15.0 * torch.rand(shape, generator=g)).log()
    if name.endswith(".dt_bias"):                                # softplus(dt_bias) = dt in [1e-3, 0.1], log-uniform
        dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(shape, generator=g))
        return dt + torch.log(-torch.expm1(-dt))                 # (Mamba's init): per-token decays of order -0.1
    if name.endswith("norm.weight") or ".q_norm." in name or ".k_norm." in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=g)        # not all-ones: a misplaced norm must show
    if "e_score_correction_bias" in name:
        return 0.05 * torch.randn(shape, generator=g)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=g)
    if name.endswith("mlp.gate.weight"):                          # router: spread scores so top-k has clear gaps
        return (1.0 / hidden ** 0.5) * torch.randn(shape, generator=g)
    if "embed_tokens" in name or "lm_head" in name:
        return 0.5 * torch.randn(shape, generator=g)
    return (1.0 / shape[-1] ** 0.5) * torch.randn(shape, generator=g)


def build_hf_config(family: str, size: str):
    import transformers

    if (family, size) not in SPECS:
        raise ValueError(f"no model spec {family!r}/{size!r}; known: {sorted(SPECS)}")
    spec = SPECS[(family, size)]
    check_routing(family, size, spec.get("text_config", spec))       # a multimodal config: its text tower's
    spec = dict(spec) if "text_config" in spec else {**_COMMON, **spec}
    cls = transformers.AutoConfig.for_model(spec.pop("model_type")).__class__
    cfg = cls(**spec)
    cfg.dtype = _DTYPE[size]
    return cfg


def _write(out: Path, family: str, size: str, seed: int) -> None:
    import transformers

    from .tokenizer import train_tokenizer

    cfg = build_hf_config(family, size)
    cls = tiny_hybrid.model_class(cfg) or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(cfg, dtype=torch.float32)
    text = getattr(cfg, "text_config", None) or cfg
    zero_centered = family in tiny_hybrid.FAMILIES
    state = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq") or "original_inv_freq" in name:
            continue
        state[name] = _init_value(name, t.shape, seed, text.hidden_size, zero_centered).to(getattr(torch, _DTYPE[size]))
    model = model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise RuntimeError(f"tiny model init left tensors unset: missing={missing} unexpected={unexpected}")
    for m in model.modules():                                    # meta-built buffers: recompute inv_freq on CPU
        if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "inv_freq"):
            m.__init__(config=getattr(m, "config", cfg))
    model.to(getattr(torch, _DTYPE[size]))
    model.save_pretrained(out, safe_serialization=True)
    if cfg.model_type == "deepseek_v3":
        _finish_deepseek_v3(out, cfg, seed)
    if family in tiny_hybrid.FAMILIES:
        tiny_hybrid.finish(out, cfg, seed, lambda n, shape: _init_value(n, shape, seed, text.hidden_size, True))
    train_tokenizer(out, vocab_size=text.vocab_size, seed=seed)
    (out / "moe_lora_rl.json").write_text(json.dumps({"family": family, "size": size, "seed": seed,
                                                      "generator_version": GENERATOR_VERSION}))


from .released import MTP_EXTRA  # noqa: E402  (the released layout's MTP-only tensors)


def mtp_tensors(names, num_layers: int, mtp_layers: int) -> list[str]:
    """The MTP tensors DeepSeek-V3 releases, as a checkpoint holding `names` would carry them: for each MTP layer
    (model.layers.{num_layers + i}) a copy of the last decoder layer's tensors plus enorm, hnorm, eh_proj,
    shared_head.norm/head and embed_tokens."""
    last = f"model.layers.{num_layers - 1}."
    out = []
    for i in range(mtp_layers):
        pre = f"model.layers.{num_layers + i}."
        out += [pre + n[len(last):] for n in names if n.startswith(last)] + [pre + n for n in MTP_EXTRA]
    return out


def _finish_deepseek_v3(out: Path, cfg, seed: int) -> None:
    """config.json gains topk_method / scoring_func (HF drops them; vLLM needs them); an MTP layer
    (num_nextn_predict_layers) is written as DeepSeek-V3 releases it, tensors model.layers.{num_hidden_layers}.*,
    which HF never builds and every loader must skip."""
    from safetensors.torch import save_file

    from .checkpoint import read_single_file

    conf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**conf, **MLA_CONFIG_EXTRA}, indent=2, sort_keys=True) + "\n")
    mtp = cfg.num_nextn_predict_layers or 0
    if not mtp:
        return
    state = read_single_file(out)
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"eh_proj.weight": (h, 2 * h), "shared_head.head.weight": (v, h), "embed_tokens.weight": (v, h)}
    last = f"model.layers.{cfg.num_hidden_layers - 1}."
    for name in mtp_tensors(list(state), cfg.num_hidden_layers, mtp):
        tail = name.split(".", 3)[3]
        like = state.get(last + tail)
        shape = like.shape if like is not None else torch.Size(shapes.get(tail, (h,)))
        state[name] = _init_value(name, shape, seed, h).to(next(iter(state.values())).dtype)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def get_model(family: str, size: str = "tiny", seed: int = 0) -> Path:
    """Path of the cached checkpoint, creating it first if needed (safe under concurrent callers)."""
    if (family, size) not in SPECS:
        raise ValueError(f"no model spec {family!r}/{size!r}; known: {sorted(SPECS)}")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / spec_key(family, size, seed)
    if (out / "moe_lora_rl.json").exists():
        return out
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "moe_lora_rl.json").exists():
            return out
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        try:
            with torch.random.fork_rng():
                _write(tmp, family, size, seed)
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return out
