"""A complete, validated LoRA adapter for a served model (pure: no vLLM import).

PEFT tensors (base_model.model.model.layers.L.<module>.lora_{A,B}.weight) are checked against the model's
architecture (every name known, A/B paired, one rank, shapes, a floating dtype, every expert of an adapted MoE projection present)
and grouped per layer. A failed check raises ValueError naming the tensor, layer and expert; nothing is applied.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..models.arch import MoEArch
from ..models.naming import naming_for
from ..transfer.wire import checksum


def module_shapes(arch: MoEArch, layer: int, module: str) -> tuple[int, int] | None:
    """(in, out) of an adaptable HF module (under model.layers.L.) of this architecture, None if it does not exist."""
    naming = naming_for(arch)
    try:
        name, part = naming.parse_hf_module(f"model.layers.{layer}.{module}")
    except ValueError:
        return None
    if name.expert is not None and not name.expert < arch.num_experts:
        return None
    template = name.linear.hf[part]
    return naming.hf_shapes(arch, layer).get(template)


@functools.lru_cache(maxsize=1 << 16)
def _parse_tensor(arch: MoEArch, name: str):
    """PEFT tensor name -> (layer, HF module, expected (in, out), (layer, expert projection template) or None,
    expert); cached: a push repeats the previous push's names. ValueError for a name the model does not have."""
    naming = naming_for(arch)
    aname, part, ab = naming.parse_peft(name)
    layer = aname.layer
    module = aname.hf_module(part)
    if layer >= arch.num_layers:
        raise ValueError(f"adapter tensor {name!r}: layer {layer} but the model has {arch.num_layers} layers")
    shape = module_shapes(arch, layer, module)
    if shape is None:
        raise ValueError(f"adapter tensor {name!r}: the served model has no module {module!r} in layer {layer}")
    expert_key = (layer, aname.linear.hf[part]) if aname.expert is not None else None
    return layer, module, ab, shape, expert_key, aname.expert


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


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


_FINITE_CHUNK = 16 << 20


def _check_finite(tensors: dict[str, torch.Tensor], version: int) -> None:
    """ValueError naming the first tensor holding inf or nan: one check per group of tensors up to _FINITE_CHUNK
    elements (a bounded copy), then a search of a failing group."""
    floats = [(n, t) for n, t in tensors.items() if t.is_floating_point() and t.numel()]
    group, size = [], 0
    for i, (_, t) in enumerate(floats):
        group.append(t.reshape(-1))
        size += t.numel()
        if i + 1 < len(floats) and size < _FINITE_CHUNK:
            continue
        if not bool(torch.isfinite(torch.cat(group)).all()):
            break
        group, size = [], 0
    else:
        return
    name = next(n for n, t in floats if not bool(torch.isfinite(t).all()))
    raise ValueError(f"adapter version {version}: tensor {name!r} holds non-finite values (inf or nan); "
                     "the served version stays")


def build_adapter_set(tensors: dict[str, torch.Tensor], arch: MoEArch, *, rank: int, alpha: float, version: int,
                      expected_checksum: str | None = None, dtype: torch.dtype = torch.float32,
                      checksum_verified: bool = False) -> AdapterSet:
    """checksum_verified: the caller already checked these exact tensors against expected_checksum (a
    shared-memory push CRC-checks while reading), so the bytes are not hashed a second time."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"adapter version must be a non-negative integer, got {version!r}")
    if rank <= 0 or alpha <= 0:
        raise ValueError(f"adapter rank={rank} / alpha={alpha} must be positive")
    if checksum_verified and expected_checksum is None:
        raise ValueError("checksum_verified needs the expected_checksum that was verified")
    got = expected_checksum if checksum_verified else checksum(tensors)
    if expected_checksum is not None and got != expected_checksum:
        raise ValueError(f"adapter version {version}: checksum mismatch (sent {expected_checksum}, "
                         f"received {got})")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, str], set[int]] = {}          # (layer, HF projection template) -> experts present
    for name, t in tensors.items():
        layer, module, ab, (din, dout), expert_key, expert = _parse_tensor(arch, name)
        if not t.is_floating_point():
            raise ValueError(f"adapter tensor {name!r} has dtype {t.dtype}; LoRA factors are floating point "
                             "(send the trainer's fp32/bf16 tensors)")
        want = (rank, din) if ab == "A" else (dout, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"adapter tensor {name!r} has shape {tuple(t.shape)}, the model needs {want} "
                             f"(rank {rank})")
        pairs.setdefault((layer, module), {})[ab] = t
        if expert_key is not None:
            experts.setdefault(expert_key, set()).add(expert)
    _check_finite(tensors, version)
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"layer {layer} {module}: lora_{'B' if 'A' in ab else 'A'} missing")
        layers.setdefault(layer, {})[module] = (_as(ab["A"], dtype), _as(ab["B"], dtype))
    for (layer, proj), have in sorted(experts.items()):
        if len(have) != arch.num_experts:
            missing = sorted(set(range(arch.num_experts)) - have)
            raise ValueError(f"layer {layer}: {proj.rsplit('.', 1)[-1]} adapters missing for experts {missing} "
                             f"(an adapted expert projection needs all {arch.num_experts} experts)")
    if not layers:
        raise ValueError("adapter has no tensors")
    return AdapterSet(version=version, checksum=got, rank=rank, scale=alpha / rank, layers=layers)
