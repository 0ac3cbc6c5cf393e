"""What the planner is given: a model (presets read from public HF configs, or any supported config.json), the
hardware figures (stated defaults with sources, overridable, or read from a bench's JSON) and the RL settings."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from . import formulas as F
from .lengths import LengthDist, parse_lengths
from .refit_calc import (SPECS, DeltaNet, MoESpec, base_params, expert_adapter_by_target,
                         mlp_adapter_by_target)


@dataclass(frozen=True)
class ModelSpec:
    moe: MoESpec                  # shapes, parameter and adapter counts: the refit calculator's
    top_k: int
    heads: int
    qk_dim: int                   # all heads' query/key width (attention FLOPs)
    v_dim: int                    # all heads' value width
    kv_bytes_per_token: float     # KV cache per token, whole model, in the cache dtype
    kv_heads: int                 # GQA: KV heads (TP must divide them); MLA: the query heads
    mla: bool                     # MLA's cached latent is shared by all heads: TP replicates it
    weight_bytes: float           # bytes per base parameter in the released checkpoint
    source: str
    attention_names: tuple[str, ...] = ()     # HF module of each moe.attention shape (attention_modules)
    attention_targets: tuple[str, ...] = ()   # its LoRA target (models/naming)
    linear_names: tuple[str, ...] = ()        # hybrid: HF module of each delta-net linear (moe.linear_attention)
    linear_targets: tuple[str, ...] = ()
    state_bytes_per_seq: float = 0.0          # hybrid: recurrent state per sequence, whole model (formulas)
    state_heads: int = 0                      # hybrid: delta-net key heads (vLLM's TP must divide them)

    def attention_bytes(self, rank: int, adapter_bytes: int = 2) -> dict[str, dict]:
        """Per attention module (HF name; a hybrid's delta-net modules too): (in, out), the layers holding it, and
        the base and rank-`rank` adapter bytes over those layers."""
        m = self.moe
        rows = [(n, io, m.full_layers) for n, io in zip(self.attention_names, m.attention)]
        rows += [(n, io, m.linear_layers) for n, io in zip(self.linear_names, m.linear_attention)]
        return {n: {"in": i, "out": o, "layers": L, "base_bytes": L * i * o * self.weight_bytes,
                    "adapter_bytes": L * rank * (i + o) * adapter_bytes} for n, (i, o), L in rows}

    def target_bytes(self, rank: int, layout: str = "per_expert", adapter_bytes: int = 2) -> dict[str, int]:
        """Adapter bytes per LoRA target over the whole model, as the refit calculator counts them (an A per HF
        attention / delta-net module, one A for a GLU fc1's gate|up); they sum to its total."""
        out: dict[str, int] = {}
        per_module = self.attention_bytes(rank, adapter_bytes)
        for name, target in zip(self.attention_names + self.linear_names, self.attention_targets + self.linear_targets):
            out[target] = out.get(target, 0) + per_module[name]["adapter_bytes"]
        mlp = {**mlp_adapter_by_target(self.moe, rank), **expert_adapter_by_target(self.moe, rank, layout)}
        out.update({k: v * adapter_bytes for k, v in mlp.items()})
        return out

    @property
    def total_params(self) -> int:
        return base_params(self.moe)

    @property
    def expert_params(self) -> int:
        m = self.moe
        return m.moe_layers * m.experts * 3 * m.hidden * m.expert_ffn

    @property
    def dense_params(self) -> int:
        """Everything that is not a routed expert (attention, embeddings, dense and shared MLPs, routers)."""
        return self.total_params - self.expert_params

    @property
    def active_params(self) -> int:
        m = self.moe
        return F.active_params(self.total_params, m.moe_layers, m.experts, self.top_k, m.hidden, m.expert_ffn)


def _g(cfg: dict, key: str, default=None):
    v = cfg.get(key, default)
    if v is None:
        raise ValueError(f"model config has no {key!r}")
    return v


def spec_from_config(name: str, cfg: dict, source: str, moe: MoESpec | None = None) -> ModelSpec:
    """A ModelSpec from an HF config.json dict: DeepSeek-V3 style (MLA: kv_lora_rank), GQA (Qwen3-MoE, GLM-4.5) or
    the hybrid (Qwen3.5/3.6-MoE, Qwen3-Next: linear_num_key_heads; a released *ForConditionalGeneration config's
    text tower is its text_config, the vision tower and MTP layers are not counted)."""
    top, cfg = cfg, cfg.get("text_config") or cfg
    H, L = _g(cfg, "hidden_size"), _g(cfg, "num_hidden_layers")
    heads = _g(cfg, "num_attention_heads")
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or _g(cfg, "num_experts")
    top_k, eff = _g(cfg, "num_experts_per_tok"), _g(cfg, "moe_intermediate_size")
    first_dense = cfg.get("first_k_dense_replace", 0) or 0
    moe_layers = L - first_dense - len(cfg.get("mlp_only_layers") or [])
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * eff
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype") or "bfloat16"
    quant = top.get("quantization_config") or cfg.get("quantization_config") or {}
    wbytes = 1 if quant.get("quant_method") == "fp8" else {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    names, att, targets = _attention_linears(cfg, "attention")
    lin_names, lin_shapes, lin_targets = _attention_linears(cfg, "linear_attention")
    linear_layers, gdn, norms, state, state_heads = 0, None, 0, 0.0, 0
    hybrid = bool(cfg.get("linear_num_key_heads"))
    if hybrid:
        norms = 2 * (cfg.get("head_dim") or H // heads)          # the gated attention's q_norm and k_norm
        linear_layers = layer_types(cfg).count("linear_attention")
    if not linear_layers:                                  # every layer full attention: no delta-net linears
        lin_names, lin_shapes, lin_targets = (), (), ()
    else:
        gdn = DeltaNet(_g(cfg, "linear_num_key_heads"), _g(cfg, "linear_num_value_heads"),
                       _g(cfg, "linear_key_head_dim"), _g(cfg, "linear_value_head_dim"),
                       _g(cfg, "linear_conv_kernel_dim"))
        if lin_shapes != gdn.linears(H):
            raise ValueError(f"{name}: the naming table's delta-net shapes {lin_shapes} differ from the refit "
                             f"calculator's {gdn.linears(H)}")
        # the state in the model dtype, as vLLM's default mamba cache dtype ("auto")
        state = F.recurrent_state_bytes_per_seq(linear_layers, gdn.conv_kernel, gdn.conv_dim, gdn.value_heads,
                                                gdn.key_head_dim, gdn.value_head_dim, 2, 2)
        state_heads = gdn.key_heads
    full_layers = L - linear_layers
    if cfg.get("kv_lora_rank"):
        r, rope, nope, v = cfg["kv_lora_rank"], _g(cfg, "qk_rope_head_dim"), _g(cfg, "qk_nope_head_dim"), \
            _g(cfg, "v_head_dim")
        qk, vd, kvh = heads * (nope + rope), heads * v, heads
        kv = F.kv_bytes_per_token_mla(L, r, rope, 2)
    else:
        hd = cfg.get("head_dim") or H // heads
        kvh = cfg.get("num_key_value_heads") or heads
        qk = vd = heads * hd
        kv = F.kv_bytes_per_token_gqa(full_layers, kvh, hd, 2)          # a hybrid's linear layers keep no KV
    derived = MoESpec(name, L, moe_layers, experts, H, eff, shared_ffn=shared,
                      dense_ffn=cfg.get("intermediate_size", 0) if first_dense else 0, vocab=_g(cfg, "vocab_size"),
                      attention=att, router_bias=cfg.get("topk_method") == "noaux_tc" or "n_group" in cfg,
                      linear_layers=linear_layers, delta_net=gdn, attention_norms=norms, shared_gate=hybrid)
    if moe is not None and moe != derived:
        raise ValueError(f"{name}: config gives {derived}, the refit calculator has {moe}")
    return ModelSpec(moe or derived, top_k, heads, qk, vd, kv, kvh, bool(cfg.get("kv_lora_rank")), wbytes, source,
                     names, targets, lin_names, lin_targets, state, state_heads)


def layer_types(cfg: dict) -> list[str]:
    """A hybrid's layer_types, or HF's default from full_attention_interval (every interval-th layer full)."""
    L = _g(cfg, "num_hidden_layers")
    types = cfg.get("layer_types")
    if types is None:
        n = cfg.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(L)]
    if len(types) != L or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types={types}: need {L} entries of linear_attention / full_attention")
    return list(types)


def attention_modules(cfg: dict) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """(HF module names, (in, out) of each) of a layer's attention linears, from an HF config.json dict, by the
    project's naming tables (models/naming): MLA (kv_lora_rank set) q_a_proj, q_b_proj (or q_proj when q_lora_rank
    is null), kv_a_proj_with_mqa, kv_b_proj, o_proj; GQA q/k/v_proj, o_proj; the hybrid's full layers q_proj (query
    and gate), k/v_proj, o_proj."""
    names, shapes, _ = _attention_linears(cfg.get("text_config") or cfg, "attention")
    return names, shapes


def _attention_linears(cfg: dict, part: str):
    """(names, shapes, LoRA targets) of the naming table's linears of `part` ("attention", or the hybrid's
    "linear_attention": in_proj_qkv, _z, _b, _a, out_proj)."""
    from types import SimpleNamespace

    from ..models.naming import deepseek_v3, glm4_moe, qwen3_5_moe
    from ..models.naming.tables import dims

    H, heads = _g(cfg, "hidden_size"), _g(cfg, "num_attention_heads")
    if cfg.get("kv_lora_rank"):
        v = _g(cfg, "v_head_dim")
        arch = SimpleNamespace(hidden_size=H, num_heads=heads, num_kv_heads=heads, head_dim=v, ffn_hidden_size=0,
                               moe_ffn_hidden_size=0, shared_expert_ffn=0, q_lora_rank=cfg.get("q_lora_rank"),
                               kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=_g(cfg, "qk_rope_head_dim"),
                               qk_nope_head_dim=_g(cfg, "qk_nope_head_dim"), v_head_dim=v)
        naming = deepseek_v3.naming(arch.q_lora_rank)
    else:
        arch = SimpleNamespace(hidden_size=H, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                               head_dim=cfg.get("head_dim") or H // heads, ffn_hidden_size=0, moe_ffn_hidden_size=0,
                               shared_expert_ffn=0)
        naming = glm4_moe.NAMING                       # the GQA attention linears (the same in every GQA family)
        if cfg.get("linear_num_key_heads"):            # the hybrid: gated q_proj, the delta-net's linears
            arch = SimpleNamespace(**vars(arch), layer_types=tuple(layer_types(cfg)),
                                   **{k: _g(cfg, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                               "linear_key_head_dim", "linear_value_head_dim")})
            naming = qwen3_5_moe.NAMING
    d, names, shapes, targets = dims(arch), [], [], []
    for li in naming.linears:
        if li.part != part:
            continue
        ins, outs = li.io
        parts = outs.split("|")
        for i, h in enumerate(li.hf):
            names.append(h)
            shapes.append((d[ins], d[parts[i] if len(parts) > 1 else outs]))
            targets.append(li.target)
    order = sorted(range(len(names)), key=lambda i: names[i].endswith("o_proj"))     # the output projection last
    return tuple(names[i] for i in order), tuple(shapes[i] for i in order), tuple(targets[i] for i in order)


# Excerpts of the public config.json files (the fields the planner reads).
KIMI_K2_CONFIG = {   # huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json (DeepseekV3ForCausalLM)
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 1, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "topk_method": "noaux_tc", "n_group": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
DEEPSEEK_V3_CONFIG = {   # huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (DeepseekV3ForCausalLM)
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
MOONLIGHT_CONFIG = {   # huggingface.co/moonshotai/Moonlight-16B-A3B/blob/main/config.json (q_lora_rank null)
    "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "first_k_dense_replace": 1, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B_CONFIG = {   # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (Qwen3MoeForCausalLM)
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}
# The hybrid family (released as Qwen3_5MoeForConditionalGeneration; these are text_config fields). Sources, as no
# config.json copy of these checkpoints is in this project's reach: [slime] THUDM/slime scripts/models/
# qwen3.5-397B-A17B.sh and qwen3.5-35B-A3B.sh (Megatron arguments read from the HF configs: --num-layers,
# --hidden-size, --num-attention-heads, --num-query-groups, --kv-channels, --num-experts, --moe-router-topk,
# --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, --vocab-size, --untie-embeddings-and-output-weights,
# --linear-*); [mimo] NVIDIA/Megatron-LM examples/mimo/configs/qwen35_vlm.py ("All values match the HuggingFace
# text_config for Qwen3.5-397B-A17B"); [slime36] THUDM/slime scripts/models/qwen36-35B-A3B.sh ("Qwen3.6-35B-A3B uses
# the same language/MoE topology as the Qwen3.5-35B-A3B config" and sources that file); [card36] the Qwen3.6-35B-A3B
# model card (quoted at mera.a-ai.ru/en/industrial/submits/181): 40 layers, hidden 2048, delta-net 32 V / 16 QK heads
# of 128, attention 16 Q / 2 KV heads of 256, 256 experts, 8 routed + 1 shared, expert size 512, vocab 248320.
# dtype is in none of them: bf16 (the default here; the FP8 weights are separate -FP8 repositories). The MTP layer
# (mtp_num_hidden_layers 1) and the vision tower are not counted: RL trains and serves the text backbone.
QWEN3_5_397B_A17B_CONFIG = {"text_config": {
    "num_hidden_layers": 60, "hidden_size": 4096,                         # [slime] [mimo]
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,  # [slime] [mimo]
    "num_experts": 512, "num_experts_per_tok": 10,                        # [slime] [mimo]
    "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,   # [slime] [mimo]
    "vocab_size": 248320,                                                 # [slime]
    "full_attention_interval": 4,                                         # [mimo] linear_attention_freq 4
    "linear_num_key_heads": 16, "linear_num_value_heads": 64,             # [mimo]
    "linear_key_head_dim": 128, "linear_value_head_dim": 128,             # [mimo]
    "linear_conv_kernel_dim": 4,                                          # [mimo]
}, "tie_word_embeddings": False}                                          # [slime] [mimo] untied
QWEN3_5_35B_A3B_CONFIG = {"text_config": {
    "num_hidden_layers": 40, "hidden_size": 2048,                         # [slime] qwen3.5-35B-A3B.sh
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,  # [slime]
    "num_experts": 256, "num_experts_per_tok": 8,                         # [slime]
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,  # [slime]
    "vocab_size": 248320,                                                 # [slime]
    "full_attention_interval": 4,                                         # [slime] --linear-attention-freq 4
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,             # [slime]
    "linear_key_head_dim": 128, "linear_value_head_dim": 128,             # [slime]
    "linear_conv_kernel_dim": 4,                                          # [slime]
}, "tie_word_embeddings": False}                                          # [slime] untied
QWEN3_6_35B_A3B_CONFIG = QWEN3_5_35B_A3B_CONFIG                           # [slime36], every value agrees with [card36]
PRESETS = {
    "kimi-k2": lambda: spec_from_config("kimi-k2", KIMI_K2_CONFIG, "moonshotai/Kimi-K2-Instruct config.json",
                                        SPECS["kimi-k2"]),
    "deepseek-v3": lambda: spec_from_config("deepseek-v3", DEEPSEEK_V3_CONFIG, "deepseek-ai/DeepSeek-V3 config.json"),
    "moonlight": lambda: spec_from_config("moonlight", MOONLIGHT_CONFIG, "moonshotai/Moonlight-16B-A3B config.json"),
    "qwen3-30b-a3b": lambda: spec_from_config("qwen3-30b-a3b", QWEN3_30B_A3B_CONFIG,
                                              "Qwen/Qwen3-30B-A3B config.json", SPECS["qwen3-30b-a3b"]),
    "qwen3.5-397b-a17b": lambda: spec_from_config("qwen3.5-397b-a17b", QWEN3_5_397B_A17B_CONFIG,
                                                  "Qwen/Qwen3.5-397B-A17B text_config (slime, Megatron-LM mimo)"),
    "qwen3.5-35b-a3b": lambda: spec_from_config("qwen3.5-35b-a3b", QWEN3_5_35B_A3B_CONFIG,
                                                "Qwen/Qwen3.5-35B-A3B text_config (slime)"),
    "qwen3.6-35b-a3b": lambda: spec_from_config("qwen3.6-35b-a3b", QWEN3_6_35B_A3B_CONFIG,
                                                "Qwen/Qwen3.6-35B-A3B text_config (slime, model card)"),
}


def load_model(name_or_dir: str) -> ModelSpec:
    """A preset name, or a checkpoint directory / config.json path of a supported family."""
    if name_or_dir in PRESETS:
        return PRESETS[name_or_dir]()
    p = Path(name_or_dir)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"model {name_or_dir!r}: not a preset ({', '.join(PRESETS)}) nor a config.json / "
                         "checkpoint directory")
    return spec_from_config(p.parent.name, json.loads(p.read_text()), str(p))


@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures. Defaults: an 80 GB H800/H100 SXM node of 8 (Mind Lab's trillion-parameter LoRA RL ran on
    64 x H800)."""
    memory_GB: float = 80.0           # H100/H800 SXM5 80 GB HBM3 (NVIDIA H100 datasheet)
    usable_fraction: float = 0.9      # allocator, CUDA context, fragmentation (vLLM's gpu_memory_utilization=0.9)
    bf16_TFLOPs: float = 989.0        # dense BF16 tensor core, H100/H800 SXM5 (NVIDIA H100 datasheet)
    hbm_GBps: float = 3350.0          # H100/H800 SXM5 HBM3 bandwidth (NVIDIA H100 datasheet)
    train_mfu: float = 0.25           # guess [?]: large-MoE Megatron training with EP all-to-all and recompute
    decode_bw_eff: float = 0.6        # guess [?]: achieved fraction of HBM bandwidth in decode
    decode_flops_eff: float = 0.3     # guess [?]: achieved fraction of peak FLOPs in decode GEMMs
    link_GBps: float = 25.0           # trainer -> engine refit link: the refit calculator's default (200 Gb/s NIC)
    gpus_per_node: int = 8            # HGX/DGX H100/H800 node
    source: str = "defaults (NVIDIA H100/H800 SXM5 datasheet; efficiencies are guesses)"

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"hardware {f.name}={v!r}: must be a positive number")
        for f in ("usable_fraction", "train_mfu", "decode_bw_eff", "decode_flops_eff"):
            if getattr(self, f) > 1:
                raise ValueError(f"hardware {f}={getattr(self, f)}: a fraction must be <= 1")

    def to_dict(self) -> dict:
        return asdict(self)


def load_hardware(path: str | None = None, **overrides) -> Hardware:
    """Defaults, then the "hardware" object of a bench JSON (e.g. `python -m moe_lora_rl.bench plan --json`),
    then explicit overrides. Unknown keys are a ValueError."""
    hw = Hardware()
    if path:
        try:
            data = json.loads(Path(path).read_text().strip().splitlines()[-1])
        except (OSError, IndexError, json.JSONDecodeError) as e:
            raise ValueError(f"hardware JSON {path!r}: cannot read one JSON object from its last line ({e})")
        data = data.get("hardware", data) if isinstance(data, dict) else data
        if not isinstance(data, dict):
            raise ValueError(f"hardware JSON {path!r}: expected an object, got {type(data).__name__}")
        known = {f.name for f in fields(Hardware)}
        bad = sorted(set(data) - known)
        if bad:
            raise ValueError(f"hardware JSON {path}: unknown keys {bad}; known: {sorted(known)}")
        hw = replace(hw, **{"source": path, **data})
    return replace(hw, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class RLSettings:
    batch: int = 512                  # samples (prompt + response) per optimizer step
    prompt_len: int = 1024
    response_len: int = 8192
    rank: int = 128
    adapter_layout: str = "per_expert"
    mode: str = "async"               # "sync" | "async"
    staleness: int = 1                # max policy versions a sample may lag (async)
    micro_batch: int = 1
    recompute: bool = True            # full activation recomputation in training
    max_engine_concurrency: int = 256 # vLLM's max_num_seqs default
    lengths: str | None = None        # response-length distribution (lengths.py); None: every answer response_len,
                                      # which stays the cap (max_tokens) that memory is sized for
    ahead: int | None = None          # async: updates the producer may admit ahead of the pushes (None: the bound)

    def __post_init__(self):
        for f in ("batch", "prompt_len", "response_len", "rank", "micro_batch", "max_engine_concurrency"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r}: must be an integer >= 1")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode={self.mode!r}: choose 'sync' or 'async'")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r}: must be an integer >= 0")
        if self.mode == "async" and self.staleness == 0:
            raise ValueError("staleness bound 0 with mode 'async': asynchronous RL lets a sample lag at least one "
                             "policy version; use --staleness >= 1 or --mode sync")
        if self.batch % self.micro_batch:
            raise ValueError(f"batch {self.batch} is not a multiple of micro_batch {self.micro_batch}")
        self.length_dist                # parse now: a bad distribution fails here, naming the value
        if self.ahead is not None:
            if isinstance(self.ahead, bool) or not isinstance(self.ahead, int) or self.ahead < 1:
                raise ValueError(f"ahead={self.ahead!r}: the producer admits an integer >= 1 updates ahead")
            if self.mode == "sync":
                raise ValueError(f"ahead={self.ahead}: mode 'sync' admits nothing ahead; use --mode async")
            if self.ahead > self.staleness:
                raise ValueError(f"ahead={self.ahead}: the staleness bound {self.staleness} cannot hold groups "
                                 f"admitted {self.ahead} updates ahead (each lags at least {self.ahead} pushes); "
                                 f"use ahead <= {self.staleness} or max staleness >= {self.ahead}")

    @property
    def length_dist(self) -> LengthDist:
        return parse_lengths(str(self.response_len) if self.lengths is None else self.lengths, self.response_len)

    @property
    def ahead_limit(self) -> int:
        return self.staleness if self.ahead is None else self.ahead

    @property
    def train_context(self) -> float:
        """Mean attention context of a trained token, token-weighted: the prompt + half its answer on average."""
        d = self.length_dist
        return (self.prompt_len ** 2 + 2 * self.prompt_len * d.mean + 2 * d.mean * d.decode_context) / \
            (2 * (self.prompt_len + d.mean))

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len
