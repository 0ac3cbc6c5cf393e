"""The rows every family's Naming is built from (pure): the Megatron parameters and the HF tensors each is assembled
from (ParamRow), and the adaptable linears with their module names in Megatron, HF and vLLM (Linear), grouped as the
families share them; `dims` resolves a Linear's dimension names for an architecture. A family module picks its rows
(and adds its own, deepseek_v3's MLA) and builds its Naming (translate.py)."""
from __future__ import annotations

from dataclasses import dataclass

PEFT_PREFIX = "base_model.model.model."
HF_LAYER = "model.layers.{L}."
MEGATRON_LAYER = "decoder.layers.{l}."


@dataclass(frozen=True)
class ParamRow:
    """A Megatron parameter (local name, {l}/{e}) and the HF tensors it is assembled from ({L}/{E}), with the shard
    kind that says how (see megatron/hf_load.py): replicated, vocab, column, row, glu, qkv, grouped_glu, grouped_row."""
    megatron: str
    hf: tuple[str, ...]
    kind: str
    expert: bool = False


@dataclass(frozen=True)
class Linear:
    """An adaptable linear. Module names are under the layer prefix of their system."""
    target: str                   # LoRA target name (lora/config.py groups them)
    part: str                     # "attention" | "dense" | "shared" | "expert"
    megatron: str                 # local Megatron module, {e} = local expert
    hf: tuple[str, ...]           # HF modules in output order ({E} = global expert); fused Megatron outputs split
    vllm: str                     # vLLM module holding all of `hf` as output slices (experts: the fused parameter)
    parallel: str                 # base linear kind in Megatron: "column" | "row"
    io: tuple[str, str]           # (in, out) dimension names per HF module, resolved by `dims`
    vllm_slice: int = 0           # output slice of `vllm` where hf[0] starts (another linear may own the others)
    vllm_parts: tuple[tuple[str, int], ...] = ()   # per HF part (vLLM module, slice) when the parts lie in several
                                                   # vLLM modules (the delta-net's in_proj_qkvz / in_proj_ba)
    b_rows: str = ""              # how B's canonical rows map onto the HF parts when not as qkv / gate-up do
                                  # (refit/rename.py): qkv_gated, gdn_in, gdn_in_next

    def vllm_slot(self, part: int) -> tuple[str, int]:
        """(vLLM module, output slice) of HF output part `part`."""
        return self.vllm_parts[part] if self.vllm_parts else (self.vllm, self.vllm_slice + part)

    @property
    def canonical(self) -> str:
        return self.megatron.replace("local_experts.{e}", "{E}")


def _hf(p: str) -> str:
    return HF_LAYER + p


_ATT = MEGATRON_LAYER + "self_attention."
DENSE_MLP_PARAMS = (
    ParamRow(MEGATRON_LAYER + "mlp.linear_fc1.weight", (_hf("mlp.gate_proj.weight"), _hf("mlp.up_proj.weight")), "glu"),
    ParamRow(MEGATRON_LAYER + "mlp.linear_fc2.weight", (_hf("mlp.down_proj.weight"),), "row"),
)
EXPERT_PARAMS = (                # SequentialMLP / TEGroupedMLP: per local expert, from the per-expert HF tensors
    ParamRow(MEGATRON_LAYER + "mlp.experts.local_experts.{e}.linear_fc1.weight",
             (_hf("mlp.experts.{E}.gate_proj.weight"), _hf("mlp.experts.{E}.up_proj.weight")), "glu", expert=True),
    ParamRow(MEGATRON_LAYER + "mlp.experts.local_experts.{e}.linear_fc2.weight",
             (_hf("mlp.experts.{E}.down_proj.weight"),), "row", expert=True),
)
COMMON_PARAMS: tuple[ParamRow, ...] = (
    ParamRow("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ParamRow("output_layer.weight", ("lm_head.weight",), "vocab"),
    ParamRow("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ParamRow(MEGATRON_LAYER + "input_layernorm.weight", (_hf("input_layernorm.weight"),), "replicated"),
    ParamRow(MEGATRON_LAYER + "pre_mlp_layernorm.weight", (_hf("post_attention_layernorm.weight"),), "replicated"),
    ParamRow(_ATT + "linear_qkv.weight", tuple(_hf(f"self_attn.{p}_proj.weight") for p in "qkv"), "qkv"),
    ParamRow(_ATT + "linear_qkv.bias", tuple(_hf(f"self_attn.{p}_proj.bias") for p in "qkv"), "qkv"),
    ParamRow(_ATT + "linear_proj.weight", (_hf("self_attn.o_proj.weight"),), "row"),
    *DENSE_MLP_PARAMS,
    ParamRow(MEGATRON_LAYER + "mlp.router.weight", (_hf("mlp.gate.weight"),), "replicated"),
    *EXPERT_PARAMS,
    # legacy GroupedMLP: all local experts in one tensor, per expert [hidden, 2*ffn/etp] and [ffn/etp, hidden]
    ParamRow(MEGATRON_LAYER + "mlp.experts.weight1",
             (_hf("mlp.experts.{E}.gate_proj.weight"), _hf("mlp.experts.{E}.up_proj.weight")), "grouped_glu",
             expert=True),
    ParamRow(MEGATRON_LAYER + "mlp.experts.weight2", (_hf("mlp.experts.{E}.down_proj.weight"),), "grouped_row",
             expert=True),
)
QK_NORM_PARAMS = (ParamRow(_ATT + "q_layernorm.weight", (_hf("self_attn.q_norm.weight"),), "replicated"),
                  ParamRow(_ATT + "k_layernorm.weight", (_hf("self_attn.k_norm.weight"),), "replicated"))
EXPERT_BIAS_PARAMS = (ParamRow(MEGATRON_LAYER + "mlp.router.expert_bias",
                               (_hf("mlp.gate.e_score_correction_bias"),), "replicated"),)
SHARED_EXPERT_PARAMS = (
    ParamRow(MEGATRON_LAYER + "mlp.shared_experts.linear_fc1.weight",
             (_hf("mlp.shared_experts.gate_proj.weight"), _hf("mlp.shared_experts.up_proj.weight")), "glu"),
    ParamRow(MEGATRON_LAYER + "mlp.shared_experts.linear_fc2.weight", (_hf("mlp.shared_experts.down_proj.weight"),),
             "row"),
)

_X = "mlp.experts.{E}."
ATTENTION_LINEARS = (
    Linear("qkv", "attention", "self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj",
           "self_attn.v_proj"), "self_attn.qkv_proj", "column", ("hidden", "q|kv|kv")),
    Linear("proj", "attention", "self_attention.linear_proj", ("self_attn.o_proj",), "self_attn.o_proj", "row",
           ("q", "hidden")),
)
DENSE_LINEARS = (
    Linear("dense_fc1", "dense", "mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj", "column",
           ("hidden", "ffn")),
    Linear("dense_fc2", "dense", "mlp.linear_fc2", ("mlp.down_proj",), "mlp.down_proj", "row", ("ffn", "hidden")),
)
SHARED_EXPERT_LINEARS = (
    Linear("shared_fc1", "shared", "mlp.shared_experts.linear_fc1",
           ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp.shared_experts.gate_up_proj",
           "column", ("hidden", "shared_ffn")),
    Linear("shared_fc2", "shared", "mlp.shared_experts.linear_fc2", ("mlp.shared_experts.down_proj",),
           "mlp.shared_experts.down_proj", "row", ("shared_ffn", "hidden")),
)
EXPERT_LINEARS = (
    Linear("expert_fc1", "expert", "mlp.experts.local_experts.{e}.linear_fc1", (_X + "gate_proj", _X + "up_proj"),
           "mlp.experts.w13_weight", "column", ("hidden", "moe_ffn")),
    Linear("expert_fc2", "expert", "mlp.experts.local_experts.{e}.linear_fc2", (_X + "down_proj",),
           "mlp.experts.w2_weight", "row", ("moe_ffn", "hidden")),
)
# the router and the shared expert's gate are target names only so that asking for them gives a clear error
# (lora/apply.py)
ROUTER_TARGET = ("router", "mlp.router")
SHARED_GATE_TARGET = ("shared_gate", "mlp.shared_experts.gate_weight")


def dims(arch) -> dict[str, int]:
    """Dimension names used by Linear.io, for an architecture (models.arch.MoEArch). With MLA, "q" is the output
    projection's input (heads x v_head_dim, arch.head_dim = v_head_dim) and the MLA widths are added; a hybrid
    (layer_types) adds the delta-net's widths and the gated q_proj's (query and gate)."""
    out = {"hidden": arch.hidden_size, "q": arch.num_heads * arch.head_dim, "kv": arch.num_kv_heads * arch.head_dim,
           "ffn": arch.ffn_hidden_size, "moe_ffn": arch.moe_ffn_hidden_size, "shared_ffn": arch.shared_expert_ffn}
    if getattr(arch, "layer_types", ()):
        k, v = arch.linear_num_key_heads * arch.linear_key_head_dim, arch.linear_num_value_heads * arch.linear_value_head_dim
        out.update(lin_qkv=2 * k + v, lin_v=v, lin_heads=arch.linear_num_value_heads, lin_qkvz=2 * k + 2 * v,
                   lin_ba=2 * arch.linear_num_value_heads, q_gate=2 * arch.num_heads * arch.head_dim)
    if getattr(arch, "kv_lora_rank", None) is not None:
        out.update(q_rank=arch.q_lora_rank or 0, kv_rank=arch.kv_lora_rank,
                   kv_a=arch.kv_lora_rank + arch.qk_rope_head_dim,
                   q_heads=arch.num_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim),
                   kv_heads=arch.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim))
    return out
