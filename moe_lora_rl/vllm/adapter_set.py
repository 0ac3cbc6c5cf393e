"""A complete, validated LoRA adapter for a served model (pure: no vLLM import).

PEFT tensors (base_model.model.model.layers.L.<module>.lora_{A,B}.weight) are checked against the model's
architecture (every name known, A/B paired, one rank, shapes, every expert of an adapted MoE projection present)
and grouped per layer. A failed check raises ValueError naming the tensor, layer and expert; nothing is applied.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import torch

from ..models.arch import MoEArch

_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 chained over names, dtypes, shapes and bytes in name order (the same on trainer and engine): detects
    corrupted, truncated or reordered payloads at memory speed (sha256 would cost more than the transfer)."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.view(torch.uint8).numpy().data, crc)
    return f"crc32:{crc:08x}:{len(tensors)}"


def module_shapes(arch: MoEArch, layer: int, module: str) -> tuple[int, int] | None:
    """(in, out) of an adaptable HF module of this architecture, None if the module does not exist."""
    h, hd = arch.hidden_size, arch.head_dim
    moe = arch.moe_layers[layer]
    table = {
        "self_attn.q_proj": (h, arch.num_heads * hd), "self_attn.k_proj": (h, arch.num_kv_heads * hd),
        "self_attn.v_proj": (h, arch.num_kv_heads * hd), "self_attn.o_proj": (arch.num_heads * hd, h),
    }
    if not moe:
        table.update({"mlp.gate_proj": (h, arch.ffn_hidden_size), "mlp.up_proj": (h, arch.ffn_hidden_size),
                      "mlp.down_proj": (arch.ffn_hidden_size, h)})
    elif arch.shared_expert_ffn:
        s = arch.shared_expert_ffn
        table.update({"mlp.shared_experts.gate_proj": (h, s), "mlp.shared_experts.up_proj": (h, s),
                      "mlp.shared_experts.down_proj": (s, h)})
    e = _EXPERT.match(module)
    if e and moe and int(e.group(1)) < arch.num_experts:
        f = arch.moe_ffn_hidden_size
        return {"gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[e.group(2)]
    return table.get(module)


@dataclass
class AdapterSet:
    version: int
    checksum: str
    rank: int
    scale: float
    # layer -> module -> (A [r, in], B [out, r]); routed experts under "mlp.experts.E.<proj>"
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def num_tensors(self) -> int:
        return 2 * sum(len(m) for m in self.layers.values())


def build_adapter_set(tensors: dict[str, torch.Tensor], arch: MoEArch, *, rank: int, alpha: float, version: int,
                      expected_checksum: str | None = None, dtype: torch.dtype = torch.float32) -> AdapterSet:
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"adapter version must be a non-negative integer, got {version!r}")
    if rank <= 0 or alpha <= 0:
        raise ValueError(f"adapter rank={rank} / alpha={alpha} must be positive")
    got = checksum(tensors)
    if expected_checksum is not None and got != expected_checksum:
        raise ValueError(f"adapter version {version}: checksum mismatch (sent {expected_checksum}, "
                         f"received {got})")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if not m:
            raise ValueError(f"adapter tensor {name!r} is not a PEFT LoRA name "
                             "(base_model.model.model.layers.L.<module>.lora_A|B.weight)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= arch.num_layers:
            raise ValueError(f"adapter tensor {name!r}: layer {layer} but the model has {arch.num_layers} layers")
        shape = module_shapes(arch, layer, module)
        if shape is None:
            raise ValueError(f"adapter tensor {name!r}: the served model has no module {module!r} in layer {layer}")
        din, dout = shape
        want = (rank, din) if ab == "A" else (dout, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"adapter tensor {name!r} has shape {tuple(t.shape)}, the model needs {want} "
                             f"(rank {rank})")
        pairs.setdefault((layer, module), {})[ab] = t
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"layer {layer} {module}: lora_{'B' if 'A' in ab else 'A'} missing")
        layers.setdefault(layer, {})[module] = (ab["A"].to(dtype).contiguous(), ab["B"].to(dtype).contiguous())
    for layer, mods in layers.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = {int(_EXPERT.match(m).group(1)) for m in mods if _EXPERT.match(m) and m.endswith(proj)}
            if have and len(have) != arch.num_experts:
                missing = sorted(set(range(arch.num_experts)) - have)
                raise ValueError(f"layer {layer}: {proj} adapters missing for experts {missing} "
                                 f"(an adapted expert projection needs all {arch.num_experts} experts)")
    if not layers:
        raise ValueError("adapter has no tensors")
    return AdapterSet(version=version, checksum=got, rank=rank, scale=alpha / rank, layers=layers)
