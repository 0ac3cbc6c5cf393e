"""Serve LoRA adapters inside a vLLM model without vLLM's LoRA machinery (which cannot run expert LoRA on CPU or
under expert parallelism):

    linear hooks      qkv_proj / o_proj / dense and shared-expert gate_up_proj, down_proj: y += s * B(A(x)) per
                      output slice (vLLM's own kernels stay for the base linears)
    routed experts    one of two serving modes, chosen per engine (additional_config={"moe_lora_serving": MODE},
                      or moe_lora_set_mode while no adapter is served):
        merged        W_base + s * B @ A folded into the weights of vLLM's own MoE kernel at each commit (merge.py);
                      the MoE path runs vLLM's code only
        unmerged      the MoE block's forward replaced by batched routed experts in plain torch (moe_torch.py) +
                      vLLM's shared experts (with their hooks); routing capture is fed from our router

The active adapter is swapped by reference after it was fully validated (and, merged, after every layer was
staged), so a failed push leaves the previous version serving. Supports vLLM tensor parallel size 1 (the CPU
engine's layout).
"""
from __future__ import annotations

import types
from pathlib import Path

import torch

from ..models.arch import MoEArch, arch_from_hf_config
from ..models.checkpoint import HFCheckpoint
from ..models.naming import naming_for
from .adapter_set import AdapterSet
from .merge import MergedExperts
from .moe_torch import BaseExperts, ExpertLoRA, load_base_experts, routed_experts, stack_expert_lora

MODES = ("unmerged", "merged")


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"moe_lora_serving={mode!r}: expected one of {MODES}")
    return mode


def _resolve(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def _router(block):
    """vLLM's router of a MoE block (the object routing capture binds its capture_fn to)."""
    for mod in block.modules():
        router = getattr(mod, "router", None)
        if router is not None and hasattr(router, "set_capture_fn"):
            return router
    raise ValueError(f"no MoE router with a capture hook in {type(block).__name__}")


class LoRARuntime:
    def __init__(self, model, model_dir: str | Path, mode: str = "unmerged", dtype: torch.dtype | None = None):
        import transformers

        from vllm.distributed import get_tensor_model_parallel_world_size

        self.model, self.model_dir = model, Path(model_dir)
        tp = get_tensor_model_parallel_world_size()
        if tp != 1:
            raise ValueError(f"the plain-torch LoRA runtime supports vLLM tensor_parallel_size=1, got {tp}")
        self.mode = check_mode(mode)
        self.dtype = dtype or next(model.parameters()).dtype
        self.arch: MoEArch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(str(self.model_dir)))
        self.active: AdapterSet | None = None
        self.layers = model.model.layers
        self.blocks = {li: layer.mlp for li, layer in enumerate(self.layers) if self.arch.moe_layers[li]}
        self._base: dict[int, BaseExperts] = {}
        self._loras: dict[int, ExpertLoRA] = {}
        self._merged: MergedExperts | None = None
        self._merged_version: int | None = None
        self._hooks = []
        self._install_linear_hooks()

    # -- base expert weights, read once from the served checkpoint (the pristine copy of the merged mode) ------
    def _base_experts(self, layer: int) -> BaseExperts:
        if layer not in self._base:
            if not hasattr(self, "_ckpt"):
                self._ckpt = HFCheckpoint(self.model_dir)
            self._base[layer] = load_base_experts(self._ckpt, self.arch, layer, self.dtype)
        return self._base[layer]

    def _merger(self) -> MergedExperts:
        if self._merged is None:
            self._merged = MergedExperts(self.blocks, {l: self._base_experts(l) for l in self.blocks}, self.dtype)
        return self._merged

    # -- hooks -------------------------------------------------------------------------------------------
    def _install_linear_hooks(self) -> None:
        for li, layer in enumerate(self.layers):
            naming = naming_for(self.arch)
            for vname, parts in naming.vllm_linears().items():
                mod = _resolve(layer, vname)
                if mod is None:
                    continue
                shapes = naming.hf_shapes(self.arch, li)
                sizes = [shapes[p][1] for p in parts]
                self._hooks.append(mod.register_forward_hook(self._make_linear_hook(li, parts, sizes)))

    def _make_linear_hook(self, layer: int, parts: tuple[str, ...], sizes: list[int]):
        def hook(module, args, output):
            adapter = self.active
            mods = adapter.layers.get(layer) if adapter else None
            if not mods or not any(p in mods for p in parts):
                return output
            x = args[0]
            out, bias = output if isinstance(output, tuple) else (output, None)
            deltas = []
            for p, n in zip(parts, sizes):
                if p in mods:
                    A, B = mods[p]
                    deltas.append(((x.to(A.dtype) @ A.t()) @ B.t()) * adapter.scale)
                else:
                    deltas.append(out.new_zeros(*out.shape[:-1], n, dtype=torch.float32))
            new = out + torch.cat(deltas, dim=-1).to(out.dtype)
            return (new, bias) if isinstance(output, tuple) else new
        return hook

    def _moe_forward(self, layer: int):
        runtime = self

        def forward(block, hidden_states):
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            logits, _ = block.gate(x)
            # routing capture (capture.py) listens on vLLM's router, which this path bypasses: report to it
            out = routed_experts(x, logits, runtime._base_experts(layer), runtime.arch, runtime._loras.get(layer),
                                 on_route=_router(block).capture_fn)
            shared = getattr(block, "shared_experts", None)
            if shared is not None:
                out = out + shared(x)
            return out.reshape(shape)
        return forward

    def _set_moe_path(self, layers) -> None:
        """The plain-torch MoE forward on exactly these layers, vLLM's own on the others."""
        for li, block in self.blocks.items():
            if li in layers and "forward" not in block.__dict__:
                block.forward = types.MethodType(self._moe_forward(li), block)
            elif li not in layers and "forward" in block.__dict__:
                del block.forward

    # -- adapter versions ----------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        check_mode(mode)
        if mode != self.mode and self.active is not None:
            raise ValueError(f"cannot switch the serving mode to {mode!r} while adapter version "
                             f"{self.active.version} is served in {self.mode!r} mode (moe_lora_clear first)")
        self.mode = mode

    def activate(self, adapter: AdapterSet) -> dict:
        """Serve `adapter`; returns timings. Nothing changes unless every step before the swap succeeded."""
        import time

        if self.active is not None and adapter.version <= self.active.version:
            raise ValueError(f"stale adapter version {adapter.version}: version {self.active.version} is served")
        t0 = time.perf_counter()
        dtype = torch.float32 if self.mode == "merged" else self.dtype
        loras = {}
        for li, mods in adapter.layers.items():
            lora = stack_expert_lora(mods, self.arch, adapter.rank, adapter.scale, dtype)
            if lora is not None:
                if li not in self.blocks:
                    raise ValueError(f"adapter version {adapter.version}: expert factors for layer {li}, which has "
                                     "no routed experts in the served model")
                loras[li] = lora
                self._base_experts(li)                 # read base expert weights before switching
        if self.mode == "merged":
            merger = self._merger()
            staged = merger.stage(loras)
            self.active = adapter
            merger.commit(staged)
            self._merged_version = adapter.version
            self._set_moe_path(())
        else:
            self._loras = loras
            self.active = adapter
            self._set_moe_path(loras)
        return {"commit_s": time.perf_counter() - t0}

    def deactivate(self) -> None:
        if self._merged_version is not None:
            merger = self._merger()
            merger.commit(merger.stage({}))
            self._merged_version = None
        self.active = None
        self._loras = {}
        self._set_moe_path(())

    def status(self) -> dict:
        a = self.active
        return {"version": a.version if a else None, "checksum": a.checksum if a else None,
                "num_tensors": a.num_tensors if a else 0, "mode": self.mode}
