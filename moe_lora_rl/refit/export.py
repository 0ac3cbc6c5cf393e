"""Canonical adapters -> an HF PEFT adapter directory (adapter_model.safetensors + adapter_config.json), with
global expert ids: base_model.model.model.layers.L.<module>.lora_{A,B}.weight, lora_A [r, in], lora_B [out, r],
scale lora_alpha / r. Whole adapters (save_peft) or bucket by bucket (refit/gather.py: stream_to_peft) through
`SafetensorsWriter`, which writes the header first and then the data in plan order.

An export whose adapter vLLM's own LoRA would silently drop (an MLA model's kv_b_proj: absorbed decode never calls
the layer) prints one line saying so (vllm_lora_note) and names the merged checkpoint that serves it anywhere
(refit/merged.py)."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch

from ..lora.config import LoRAConfig
from ..models.arch import MoEArch
from ..models.naming import naming_for
from ..transfer.wire import nbytes
from .rename import to_peft_tensors

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# LoRA targets vLLM's own LoRA (--enable-lora) ignores, with the HF module it leaves unadapted: MLA's kv_b_proj is
# never called by absorbed decode (W_UK_T / W_UV are derived from its weight at load; docs/mla.md)
VLLM_LORA_DROPS = {"kv_up": "kv_b_proj"}


def _mlp_params(arch: MoEArch) -> tuple[str, ...]:
    # Dense-MLP and shared-expert projections share their names with the routed experts' projections; peft moves
    # every gate/up/down_proj target onto the fused expert parameters of transformers 5 MoE models, so these 2D
    # weights must be named in target_parameters to keep their adapters (vLLM reads tensor names, ignores both).
    return tuple(h + ".weight" for li in naming_for(arch).linears if li.part in ("dense", "shared") for h in li.hf)


def peft_config(cfg: LoRAConfig, names, base_model: str | None, arch: MoEArch) -> dict:
    modules = {k.removeprefix("base_model.model.model.").rsplit(".lora_", 1)[0] for k in names}
    targets = sorted({m.split(".")[-1] for m in modules})
    params = sorted({p for m in modules if ".experts." not in m or ".shared_experts." in m
                     for p in _mlp_params(arch) if f"{m}.weight".endswith("." + p)})
    ranks: dict = {}
    naming = naming_for(arch)
    if naming.peft_fused_experts and any(".experts." in m and ".shared_experts." not in m for m in modules):
        # what peft's own MoE conversion writes for the families it knows: the per-expert projections as the fused
        # 3-D parameters (gate_up_proj holds gate and up: twice the rank and alpha), no module target of that name
        fused = {"gate_proj": "mlp.experts.gate_up_proj", "up_proj": "mlp.experts.gate_up_proj",
                 "down_proj": "mlp.experts.down_proj"}
        present = {m.rsplit(".", 1)[-1] for m in modules if ".experts." in m and ".shared_experts." not in m}
        targets = [t for t in targets if t not in fused]
        params = sorted(set(params) | {fused[t] for t in present})
        if "mlp.experts.gate_up_proj" in params:
            ranks = {"rank_pattern": {r".*\.gate_up_proj": 2 * cfg.rank},
                     "alpha_pattern": {r".*\.gate_up_proj": 2 * cfg.alpha}}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": 0.0, "bias": "none", "target_modules": targets, "target_parameters": params or None,
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": base_model, "inference_mode": True,
            "rank_pattern": {}, "alpha_pattern": {}, **ranks}


def write_config(out_dir: str | Path, cfg: LoRAConfig, names, arch: MoEArch, base_model: str | None) -> None:
    (Path(out_dir) / "adapter_config.json").write_text(json.dumps(peft_config(cfg, names, base_model, arch),
                                                                  indent=1))


def vllm_lora_note(names, arch: MoEArch, out_dir: str | Path, base_model: str | None) -> str | None:
    """One line when the PEFT tensors `names` hold a target vLLM's own LoRA ignores (VLLM_LORA_DROPS), naming the
    module, how many layers, and the command writing a merged checkpoint; None otherwise."""
    naming = naming_for(arch)
    hit: dict[str, set[int]] = {}
    for n in names:
        name = naming.parse_peft(n)[0]
        if name.linear.target in VLLM_LORA_DROPS:
            hit.setdefault(VLLM_LORA_DROPS[name.linear.target], set()).add(name.layer)
    if not hit:
        return None
    what = ", ".join(f"{m} ({len(layers)} layers)" for m, layers in sorted(hit.items()))
    return (f"moe_lora: warning: {out_dir} adapts {what}, which vLLM's own LoRA ignores (absorbed MLA decode "
            f"never calls it): served with --enable-lora that part is silently dropped; serve it with moe_lora_rl's "
            f"worker extension, or merge it for any server: python -m moe_lora_rl.refit.merged --model "
            f"{base_model or 'MODEL_DIR'} --adapter {out_dir} --out MERGED_DIR")


def _note(names, arch: MoEArch, out_dir, base_model) -> None:
    """The line on stderr: a bench's stdout stays its one JSON line."""
    line = vllm_lora_note(names, arch, out_dir, base_model)
    if line:
        print(line, file=sys.stderr, flush=True)


def save_peft(adapters: dict[str, torch.Tensor], arch: MoEArch, cfg: LoRAConfig, out_dir: str | Path,
              base_model: str | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_peft_tensors(adapters, arch)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    write_config(out, cfg, tensors, arch, base_model)
    _note(tensors, arch, out, base_model)
    return out


def stream_to_peft(model, arch: MoEArch, out_dir: str | Path, bucket_bytes: int = 64 << 20, writer_rank: int = 0,
                   base_model: str | None = None) -> str:
    """Collective: the PEFT adapter of a sharded model written by `writer_rank` bucket by bucket (no rank holds
    more than one bucket of it). Returns the adapter checksum."""
    import torch.distributed as dist

    from .gather import build_plan, stream

    plan = build_plan(model, arch, bucket_bytes)
    out = Path(out_dir)
    writer = None
    if dist.get_rank() == writer_rank:
        out.mkdir(parents=True, exist_ok=True)
        writer = SafetensorsWriter(out / "adapter_model.safetensors", plan.entries())
    digest = stream(model, arch, plan, lambda bucket, buf: writer.write(buf), collect_to=writer_rank)
    if writer is not None:
        writer.close()
        names = [name for name, _, _ in plan.entries()]
        write_config(out, model.lora_config, names, arch, base_model)
        _note(names, arch, out, base_model)
    return digest


def trim_peft_dir(out_dir: str | Path, policy: LoRAConfig, arch: MoEArch) -> Path:
    """A PEFT directory written from adapter modules larger than the policy's (lora/padding.py) rewritten as the
    policy's own: its targets' modules, its rank, its alpha. ValueError if what is cut is not zero."""
    from safetensors.torch import load_file, save_file

    from ..lora.padding import trim_peft

    out = Path(out_dir)
    naming = naming_for(arch)
    config = json.loads((out / "adapter_config.json").read_text())
    tensors = trim_peft(load_file(str(out / "adapter_model.safetensors")), policy,
                        lambda name: naming.parse_peft(name)[0].linear.target)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    write_config(out, policy, tensors, arch, config.get("base_model_name_or_path"))
    return out


class SafetensorsWriter:
    """A safetensors file written in order: the header (every name, dtype and shape, known from the plan) first,
    then each tensor's bytes as they arrive, so no more than the caller's buffer is ever held."""

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        for name, dtype, shape in entries:
            n = nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._left, self.total = offset, offset

    def write(self, data: torch.Tensor) -> None:
        """The next bytes of the data section (a flat uint8 tensor, e.g. one bucket buffer)."""
        self._f.write(memoryview(data.contiguous().numpy()))
        self._left -= data.numel()

    def close(self) -> None:
        self._f.close()
        if self._left:
            raise ValueError(f"safetensors file incomplete: {self._left} of {self.total} data bytes never written")


def checkpoint_to_peft(ckpt_dir: str | Path, model_dir: str | Path, out_dir: str | Path) -> Path:
    """A training checkpoint's adapters (a step directory of checkpoint/api.py, saved at any layout: the main job's
    or verl's through our engine) as a PEFT adapter of the HF checkpoint MODEL_DIR."""
    from ..lora.state import read_full
    from ..models.arch import load_arch

    adapters, cfg = read_full(ckpt_dir)
    return save_peft(adapters, load_arch(model_dir), cfg, out_dir, base_model=str(model_dir))
