"""Serve LoRA adapters inside a vLLM model without vLLM's LoRA machinery (which cannot run expert LoRA on CPU or
under expert parallelism):

    linear hooks      qkv_proj / o_proj / dense and shared-expert gate_up_proj, down_proj: y += s * B(A(x)) per
                      output slice (vLLM's own kernels stay for the base linears)
    MoE blocks        while an adapter with expert factors is active, the block's forward is replaced by routed
                      experts in plain torch (moe_torch.py) + vLLM's shared experts (with their hooks)

The active adapter is swapped by reference after it was fully validated, so a failed push leaves the previous
version serving. Supports vLLM tensor parallel size 1 (the CPU engine's layout).
"""
from __future__ import annotations

import types
from pathlib import Path

import torch

from ..models.arch import MoEArch, arch_from_hf_config
from ..models.checkpoint import HFCheckpoint
from ..models.naming import naming_for
from .adapter_set import AdapterSet
from .moe_torch import MoEWeights, load_moe_weights, routed_experts

def _resolve(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


class LoRARuntime:
    def __init__(self, model, model_dir: str | Path):
        import transformers

        from vllm.distributed import get_tensor_model_parallel_world_size

        self.model, self.model_dir = model, Path(model_dir)
        tp = get_tensor_model_parallel_world_size()
        if tp != 1:
            raise ValueError(f"the plain-torch LoRA runtime supports vLLM tensor_parallel_size=1, got {tp}")
        self.arch: MoEArch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(str(self.model_dir)))
        self.active: AdapterSet | None = None
        self.layers = model.model.layers
        self._moe: dict[int, MoEWeights] = {}
        self._hooks = []
        self._install_linear_hooks()
        self.route_log: list | None = None

    # -- base weights, read once from the served checkpoint --------------------------------------------------
    def _moe_weights(self, layer: int) -> MoEWeights:
        if layer not in self._moe:
            if not hasattr(self, "_ckpt"):
                self._ckpt = HFCheckpoint(self.model_dir)
            self._moe[layer] = load_moe_weights(self._ckpt, self.arch, layer)
        return self._moe[layer]

    # -- hooks -------------------------------------------------------------------------------------------
    def _install_linear_hooks(self) -> None:
        for li, layer in enumerate(self.layers):
            for vname, parts in naming_for(self.arch).vllm_linears().items():
                mod = _resolve(layer, vname)
                if mod is None:
                    continue
                self._hooks.append(mod.register_forward_hook(self._make_linear_hook(li, parts)))

    def _make_linear_hook(self, layer: int, parts: tuple[str, ...]):
        def hook(module, args, output):
            adapter = self.active
            mods = adapter.layers.get(layer) if adapter else None
            if not mods or not any(p in mods for p in parts):
                return output
            x = args[0]
            out, bias = output if isinstance(output, tuple) else (output, None)
            deltas, offset = [], 0
            shapes = naming_for(self.arch).hf_shapes(self.arch, layer)
            sizes = [shapes[p][1] for p in parts]
            for p, n in zip(parts, sizes):
                if p in mods:
                    A, B = mods[p]
                    deltas.append(((x.to(A.dtype) @ A.t()) @ B.t()) * adapter.scale)
                else:
                    deltas.append(out.new_zeros(*out.shape[:-1], n, dtype=torch.float32))
                offset += n
            new = out + torch.cat(deltas, dim=-1).to(out.dtype)
            return (new, bias) if isinstance(output, tuple) else new
        return hook

    def _moe_forward(self, layer: int):
        runtime = self

        def forward(block, hidden_states):
            adapter = runtime.active
            experts = adapter.layers.get(layer) if adapter else None
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            out = routed_experts(x, runtime._moe_weights(layer), runtime.arch, experts,
                                 adapter.scale if adapter else 1.0,
                                 on_route=(lambda ids: runtime.route_log.append((layer, ids.clone())))
                                 if runtime.route_log is not None else None)
            shared = getattr(block, "shared_experts", None)
            if shared is not None:
                out = out + shared(x).float()
            return out.to(hidden_states.dtype).reshape(shape)
        return forward

    def _set_moe_path(self, on: bool) -> None:
        for li, layer in enumerate(self.layers):
            if not self.arch.moe_layers[li]:
                continue
            block = layer.mlp
            if on and "forward" not in block.__dict__:
                block.forward = types.MethodType(self._moe_forward(li), block)
            elif not on and "forward" in block.__dict__:
                del block.forward

    # -- adapter versions ----------------------------------------------------------------------------------
    def activate(self, adapter: AdapterSet) -> None:
        if self.active is not None and adapter.version <= self.active.version:
            raise ValueError(f"stale adapter version {adapter.version}: version {self.active.version} is served")
        has_experts = any(k.startswith("mlp.experts.") for m in adapter.layers.values() for k in m)
        if has_experts:
            for li in adapter.layers:                 # read base expert weights before switching
                if self.arch.moe_layers[li]:
                    self._moe_weights(li)
        self.active = adapter
        self._set_moe_path(has_experts)

    def deactivate(self) -> None:
        self.active = None
        self._set_moe_path(False)

    def status(self) -> dict:
        a = self.active
        return {"version": a.version if a else None, "checksum": a.checksum if a else None,
                "num_tensors": a.num_tensors if a else 0}
