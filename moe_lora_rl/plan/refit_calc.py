"""Refit sizes by calculation: adapter and base bytes of a MoE model for each adapter layout and rank, and the
time to move them over a link. Pure arithmetic, so trillion-parameter claims are checkable by hand.

Per routed expert (GLU): fc1 [2F, H], fc2 [H, F]. LoRA factors: A [r, in], B [out, r].
    per_expert    per MoE layer: E * r * (H + 2F) + E * r * (F + H)          = E r (2H + 3F)
    shared_outer  fc1 A and fc2 B shared:  r H + E 2F r + E r F + H r         = r (2H + 3 E F)
    shared        one fc1 and one fc2 adapter per layer                       = r (2H + 3F)
Other linears (attention, shared expert, dense MLP): r * (in + out) each.

Hybrid linear attention (Qwen3.5/3.6-MoE, Qwen3-Next: `DeltaNet`): `linear_layers` of the layers are Gated DeltaNets,
the rest full (gated) attention. With key width K = nk dk, value width V = nv dv, a delta-net layer has the linears
in_proj_qkv [H -> 2K+V], in_proj_z [H -> V], in_proj_b, in_proj_a [H -> nv], out_proj [V -> H] (an adapter
r (in + out) on each, as on q/k/v) and the base parameters conv1d (2K+V) x kernel (depthwise, no bias), A_log and
dt_bias (nv each) and the gated norm (dv); a full layer adds q/k norms (`attention_norms`); a gated shared expert
adds its gate [H -> 1] (`shared_gate`).

Streaming gather (refit/gather.py), per_expert adapters, at a layout tpT ppP epN (even split, ETP 1). What travels
is PEFT tensors: a GLU fc1's A goes to gate and to up, so per expert r (3H + 3F) (canonical r (2H + 3F)).
The busiest sender is the first rank of a stage holding the most MoE layers m = min(ceil(L / P), moe layers): it
sends its E / N experts of those layers and, as the TP group's first rank of the first replica, the stage's
attention and shared-expert adapters:
    per_rank_send_bytes = b [ m (E/N) r (3H + 3F) + ceil(L/P) sum_att r (in + out) + m r (3H + 3S) ]
    per_rank_peak_bytes = bucket_bytes + its own shard
    own shard          <= b [ m (E/N) r (2H + 3F) + ceil(L/P) sum_att r (in + out) + m r (2H + 3S) ]
(the non-expert part counted unsharded: an upper bound). The all_gather_object gather instead holds every adapter
on every rank: at least the total adapter bytes per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's shape: config.json's linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim."""
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The causal conv's channels: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def linears(self, hidden: int) -> tuple[tuple[int, int], ...]:
        """(in, out) of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj (HF Qwen3.5's order)."""
        return ((hidden, self.conv_dim), (hidden, self.value_dim), (hidden, self.value_heads),
                (hidden, self.value_heads), (self.value_dim, hidden))

    @property
    def other_params(self) -> int:
        """conv1d weight, A_log, dt_bias, the gated norm's weight."""
        return self.conv_dim * self.conv_kernel + 2 * self.value_heads + self.value_head_dim


@dataclass(frozen=True)
class MoESpec:
    name: str
    num_layers: int
    moe_layers: int
    experts: int
    hidden: int
    expert_ffn: int
    shared_ffn: int = 0               # shared expert intermediate size (0 = none)
    dense_ffn: int = 0                # dense MLP layers' intermediate size
    vocab: int = 0
    attention: tuple[tuple[int, int], ...] = field(default_factory=tuple)   # (in, out) of every attention linear
    router_bias: bool = False
    linear_layers: int = 0            # hybrid: Gated DeltaNet layers; `attention` is then the full layers' only
    delta_net: DeltaNet | None = None
    attention_norms: int = 0          # norm weights per full-attention layer (q/k norms; counted for the hybrid)
    shared_gate: bool = False         # the shared expert's sigmoid gate [H -> 1]

    def __post_init__(self):
        if (self.linear_layers > 0) != (self.delta_net is not None) or not 0 <= self.linear_layers <= self.num_layers:
            raise ValueError(f"{self.name}: linear_layers={self.linear_layers} needs a delta_net and at most "
                             f"{self.num_layers} layers (delta_net={self.delta_net})")

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def full_layers(self) -> int:
        """Layers with (softmax) attention: all of them but the hybrid's linear ones."""
        return self.num_layers - self.linear_layers

    @property
    def linear_attention(self) -> tuple[tuple[int, int], ...]:
        return self.delta_net.linears(self.hidden) if self.delta_net else ()


def attention_sum(s: MoESpec, f) -> int:
    """sum of f(in, out) over every attention linear of the model: the full layers' and the delta-net layers'."""
    return (s.full_layers * sum(f(i, o) for i, o in s.attention)
            + s.linear_layers * sum(f(i, o) for i, o in s.linear_attention))


_KIMI_ATT = ((7168, 1536), (1536, 64 * (128 + 64)), (7168, 512 + 64), (512, 64 * (128 + 128)), (64 * 128, 7168))
SPECS = {
    # Kimi-K2: 61 layers (first dense), 384 routed experts + 1 shared, hidden 7168, expert FFN 2048, MLA attention
    "kimi-k2": MoESpec("kimi-k2", 61, 60, 384, 7168, 2048, shared_ffn=2048, dense_ffn=18432, vocab=163840,
                       attention=_KIMI_ATT, router_bias=True),
    # Qwen3-30B-A3B: 48 layers all MoE, 128 experts, hidden 2048, expert FFN 768, GQA 32 q / 4 kv heads of 128
    "qwen3-30b-a3b": MoESpec("qwen3-30b-a3b", 48, 48, 128, 2048, 768, vocab=151936,
                             attention=((2048, 4096), (2048, 512), (2048, 512), (4096, 2048))),
}


def expert_adapter_by_target(s: MoESpec, r: int, layout: str) -> dict[str, int]:
    """Routed-expert adapter params of the model per target (fc1 = gate|up with one A, fc2 = down), by layout."""
    H, F, E = s.hidden, s.expert_ffn, s.experts
    per_layer = {"per_expert": (E * r * (H + 2 * F), E * r * (F + H)),
                 "shared_outer": (r * H + E * 2 * F * r, E * r * F + H * r),
                 "shared": (r * (H + 2 * F), r * (F + H))}
    if layout not in per_layer:
        raise ValueError(f"adapter layout {layout!r}; choose one of {sorted(per_layer)}")
    fc1, fc2 = per_layer[layout]
    return {"expert_fc1": s.moe_layers * fc1, "expert_fc2": s.moe_layers * fc2}


def expert_adapter_params(s: MoESpec, r: int, layout: str) -> int:
    return sum(expert_adapter_by_target(s, r, layout).values())


def mlp_adapter_by_target(s: MoESpec, r: int) -> dict[str, int]:
    """Shared-expert and dense-MLP adapter params of the model per target (GLU fc1 with one A, as the experts')."""
    H, S, D, out = s.hidden, s.shared_ffn, s.dense_ffn, {}
    if S:
        out.update(shared_fc1=s.moe_layers * r * (H + 2 * S), shared_fc2=s.moe_layers * r * (S + H))
    if D and s.dense_layers:
        out.update(dense_fc1=s.dense_layers * r * (H + 2 * D), dense_fc2=s.dense_layers * r * (D + H))
    return out


def other_adapter_params(s: MoESpec, r: int) -> int:
    return attention_sum(s, lambda i, o: r * (i + o)) + sum(mlp_adapter_by_target(s, r).values())


def base_params(s: MoESpec) -> int:
    H = s.hidden
    experts = s.moe_layers * s.experts * 3 * H * s.expert_ffn
    shared = s.moe_layers * 3 * H * s.shared_ffn
    router = s.moe_layers * (s.experts * H + (s.experts if s.router_bias else 0))
    dense = s.dense_layers * 3 * H * s.dense_ffn
    att = attention_sum(s, lambda i, o: i * o)
    norms = s.num_layers * 2 * H + H + s.full_layers * s.attention_norms
    gdn = s.linear_layers * s.delta_net.other_params if s.delta_net else 0
    gate = s.moe_layers * H if s.shared_gate else 0
    return experts + shared + router + dense + att + norms + gdn + gate + 2 * s.vocab * H


def refit_report(s: MoESpec, ranks=(8, 32, 128), layouts=("per_expert", "shared_outer", "shared"),
                 bytes_per_param: int = 2, link_gbps: float = 25.0) -> dict:
    """link_gbps: link bandwidth in GB/s (e.g. 25 GB/s ~ a 200 Gb/s NIC)."""
    base_bytes = base_params(s) * bytes_per_param
    out = {"model": s.name, "base_params": base_params(s), "base_bytes": base_bytes,
           "bytes_per_param": bytes_per_param, "link_GBps": link_gbps,
           "base_refit_s": base_bytes / (link_gbps * 1e9), "adapters": {}}
    for layout in layouts:
        for r in ranks:
            n = expert_adapter_params(s, r, layout) + other_adapter_params(s, r)
            b = n * bytes_per_param
            out["adapters"][f"{layout}/r{r}"] = {"params": n, "bytes": b, "refit_s": b / (link_gbps * 1e9),
                                                 "bytes_ratio_base_over_lora": base_bytes / b}
    return out


# Kimi-K2's public Megatron training layout: Miles' recipe, 256 GPUs, TP8 PP8 CP4 EP32 (CP and the data-parallel
# degree only add replicas, which send nothing), with a 2 GiB weight-update buffer (notes/anchors.md)
KIMI_K2_LAYOUT = "tp8pp8ep32"
KIMI_K2_BUCKET = 2 << 30


def _layout(name: str) -> dict[str, int]:
    import re

    sizes = {"tp": 1, "pp": 1, "ep": 1, "etp": 1}
    text, pos = name.strip().lower(), 0
    for m in re.finditer(r"(etp|tp|pp|ep|cp|dp)(\d+)", text):
        if m.start() != pos:
            break
        sizes[m.group(1)] = int(m.group(2))
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"layout {name!r} is not a combination of tpN, ppN, epN (etpN, cpN, dpN)")
    if sizes["etp"] != 1:
        raise ValueError(f"layout {name!r}: the streaming calculator assumes expert TP 1, got etp{sizes['etp']}")
    return sizes


def streaming_report(s: MoESpec, r: int, layout: str, bucket_bytes: int, bytes_per_param: int = 2) -> dict:
    """The busiest rank of the streaming gather for per_expert adapters (see the module docstring)."""
    sizes = _layout(layout)
    pp, ep = sizes["pp"], sizes["ep"]
    if s.experts % ep:
        raise ValueError(f"layout {layout!r}: ep{ep} does not divide {s.name}'s {s.experts} experts")
    if pp > s.num_layers:
        raise ValueError(f"layout {layout!r}: pp{pp} exceeds {s.name}'s {s.num_layers} layers")
    H, F, S = s.hidden, s.expert_ffn, s.shared_ffn
    stage_layers = math.ceil(s.num_layers / pp)
    m = min(stage_layers, s.moe_layers)
    local = s.experts // ep
    # a stage's attention adapters, each layer counted as the larger of a full and a delta-net layer (upper bound)
    att = stage_layers * max(sum(r * (i + o) for i, o in a) for a in (s.attention, s.linear_attention))
    shared_send = m * r * (3 * H + 3 * S) if S else 0
    shared_own = m * r * (2 * H + 3 * S) if S else 0
    send = m * local * r * (3 * H + 3 * F) + att + shared_send
    own = m * local * r * (2 * H + 3 * F) + att + shared_own
    total = (expert_adapter_params(s, r, "per_expert") + other_adapter_params(s, r)) * bytes_per_param
    # one factor as PEFT tensors: a GLU B [2, ffn, r] split in two, a GLU A [r, H] copied twice, attention as is
    largest = max([2 * r * f for f in (s.dense_ffn, F, S, H)]
                  + [r * max(i, o) for i, o in s.attention + s.linear_attention]) * bytes_per_param
    if bucket_bytes < largest:
        raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than {s.name}'s largest adapter tensor "
                         f"({largest} bytes)")
    return {"layout": layout, "adapter_layout": "per_expert", "lora_rank": r, "bucket_bytes": bucket_bytes,
            "bytes_per_param": bytes_per_param, "stage_layers": stage_layers, "experts_per_rank": local,
            "per_rank_send_bytes": send * bytes_per_param,
            "per_rank_peak_bytes": bucket_bytes + own * bytes_per_param,
            "all_gather_object_per_rank_bytes": total}
