"""Serve LoRA adapters inside a vLLM model without vLLM's LoRA machinery (which cannot run expert LoRA on CPU or
under expert parallelism):

    linear hooks      qkv_proj / o_proj / dense and shared-expert gate_up_proj, down_proj: y += s * B(A(x)) per
                      output slice (vLLM's own kernels stay for the base linears); MLA: fused_qkv_a_proj (slices
                      q_a_proj, kv_a_proj_with_mqa), q_b_proj or q_proj, kv_a_proj_with_mqa, o_proj
    MLA kv_b_proj     merged into the weight and W_UK_T / W_UV re-derived at each commit, in both modes (mla_merge.py):
                      the absorbed decode never calls the layer, so a hook would be lost after prefill; one version at
                      a time (refused with inflight='pin')
    routed experts    one of two serving modes, chosen per engine (additional_config={"moe_lora_serving": MODE},
                      or moe_lora_set_mode while no adapter is served):
        merged        W_base + s * B @ A folded into the weights of vLLM's own MoE kernel at each commit (merge.py);
                      the MoE path runs vLLM's code only
        unmerged      the MoE block's forward replaced by batched routed experts in plain torch (moe_torch.py) +
                      vLLM's shared experts (with their hooks); routing capture is fed from our router; its GEMMs
                      run in the serving dtype or in fp32 (expert_precision, moe_torch.EXPERT_PRECISION: fp32 has
                      the numerics of vLLM's own MoE kernel, at twice the weight bytes)

Adapter versions (versions.py holds the policy): `switch` holds one version, the newest, for every token;
`pin` (unmerged only) holds up to max_versions versions at once and serves each request on the version it was
tracked with. A step with several versions is planned once, before its forward (a step_hooks.py listener): the
tokens grouped by version (token_groups.py); each linear hook adds every group's own delta to its rows, and the
routed experts route all tokens once and run the expert MLP per group with that version's factors (Punica / S-LoRA
style multi-LoRA batching). A step whose tokens all run on one version takes the single-version code, no index copies.

A new version is swapped in by reference after it was fully validated (and, merged, after every layer was staged),
so a failed push leaves the served versions as they were. Supports vLLM tensor parallel size 1 (the CPU engine's
layout).
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
from .mla_merge import KV_B, KvBMerge
from .moe_torch import (EXPERT_PRECISION, BaseExperts, ExpertLoRA, load_base_experts, routed_experts,
                        stack_expert_lora)
from .token_groups import TokenGroups, linear_delta
from .versions import (UNTRACKED_SALT, VersionTable, cache_salt, check_inflight_config, check_mode,
                       external_id)


def _resolve(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


SHARED_EXPERT = ("shared_experts", "shared_expert")
"""vLLM's attribute for a MoE block's shared expert: DeepSeek-V3 / GLM-4.5 blocks; Qwen2-MoE / Qwen3-Next / Qwen3.5
blocks (its sigmoid gate applied inside the module)."""


def _shared_expert(block):
    return next((m for m in (getattr(block, a, None) for a in SHARED_EXPERT) if m is not None), None)


def _router(block):
    """vLLM's router of a MoE block (the object routing capture binds its capture_fn to)."""
    for mod in block.modules():
        router = getattr(mod, "router", None)
        if router is not None and hasattr(router, "set_capture_fn"):
            return router
    raise ValueError(f"no MoE router with a capture hook in {type(block).__name__}")


def _check_precision(p: str) -> str:
    if p not in EXPERT_PRECISION:
        raise ValueError(f"expert_precision={p!r}: expected one of {sorted(EXPERT_PRECISION)}")
    return p


class LoRARuntime:
    def __init__(self, model, model_dir: str | Path, mode: str = "unmerged", dtype: torch.dtype | None = None,
                 inflight: str = "switch", max_versions: int | None = None, on_full: str = "wait",
                 expert_precision: str = "serving"):
        import transformers

        from vllm.distributed import get_tensor_model_parallel_world_size

        self.model, self.model_dir = model, Path(model_dir)
        tp = get_tensor_model_parallel_world_size()
        if tp != 1:
            raise ValueError(f"the plain-torch LoRA runtime supports vLLM tensor_parallel_size=1, got {tp}")
        self.mode = check_mode(mode)
        self.table = VersionTable(check_inflight_config(mode, inflight, max_versions, on_full))
        self.dtype = dtype or next(model.parameters()).dtype
        self.expert_precision = _check_precision(expert_precision)
        self.arch: MoEArch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(str(self.model_dir)))
        # a multimodal model (Qwen3.5's released layout) serves adapters on its text tower
        text = model.get_language_model() if hasattr(model, "get_language_model") else model
        self.layers = text.model.layers
        self.blocks = {li: layer.mlp for li, layer in enumerate(self.layers) if self.arch.moe_layers[li]}
        self._init_state()
        self._hooks = []
        self._install_linear_hooks()

    def _init_state(self) -> None:
        self.adapters: dict[int, AdapterSet] = {}                 # held versions
        self._loras: dict[int, dict[int, ExpertLoRA]] = {}        # version -> layer -> stacked expert factors
        self._step: TokenGroups | None = None                      # this forward's versions, when not all newest
        self._base: dict[int, BaseExperts] = {}                    # unmerged: fp32 copies the batched experts run on
        self._pristine: dict[int, BaseExperts] = {}                # merged: checkpoint values every merge starts from
        self._merged: MergedExperts | None = None
        self._merged_version: int | None = None
        self._kvb: KvBMerge | None = None                          # MLA: kv_b_proj adapters, merged + re-absorbed

    @property
    def active(self) -> AdapterSet | None:
        """The newest held version (what untracked requests and switch engines run on)."""
        v = self.table.newest
        return None if v is None else self.adapters[v]

    # -- base expert weights, read once from the served checkpoint -------------------------------------------
    # unmerged: the dtype its GEMMs run in (expert_precision); merged: the checkpoint's own dtype, so W + s*B@A is
    # rounded to the serving dtype once (an fp32 checkpoint read in bf16 first would be rounded twice)
    def _load(self, layer: int, dtype: torch.dtype | None) -> BaseExperts:
        return load_base_experts(self._checkpoint(), self.arch, layer, dtype)

    def _base_experts(self, layer: int) -> BaseExperts:
        if layer not in self._base:
            self._base[layer] = self._load(layer, EXPERT_PRECISION[self.expert_precision] or self.dtype)
        return self._base[layer]

    def _pristine_experts(self, layer: int) -> BaseExperts:
        if layer not in self._pristine:
            self._pristine[layer] = self._load(layer, None)
        return self._pristine[layer]

    def _merger(self) -> MergedExperts:
        if self._merged is None:
            self._merged = MergedExperts(self.blocks, {l: self._pristine_experts(l) for l in self.blocks}, self.dtype)
        return self._merged

    def _kv_b(self) -> KvBMerge:
        if self._kvb is None:
            read = lambda li: self._checkpoint().get(f"model.layers.{li}.{KV_B}.weight")  # noqa: E731
            self._kvb = KvBMerge(self.layers, read, self.dtype)
        return self._kvb

    def _checkpoint(self) -> HFCheckpoint:
        if not hasattr(self, "_ckpt"):
            self._ckpt = HFCheckpoint(self.model_dir)
        return self._ckpt

    # -- hooks -------------------------------------------------------------------------------------------
    def _install_linear_hooks(self) -> None:
        for li, layer in enumerate(self.layers):
            naming = naming_for(self.arch)
            for vname, parts in naming.vllm_linears().items():
                mod = _resolve(layer, vname)
                if mod is None or KV_B in parts:        # kv_b_proj: absorbed decode never calls it (mla_merge.py)
                    continue
                shapes = naming.hf_shapes(self.arch, li)
                sizes = [shapes[p][1] for p in parts]
                self._hooks.append(mod.register_forward_hook(self._make_linear_hook(li, parts, sizes)))

    def _linear_mods(self, version: int | None, layer: int, parts: tuple[str, ...]) -> dict | None:
        adapter = self.adapters.get(version) if version is not None else None
        mods = adapter.layers.get(layer) if adapter else None
        return mods if mods and any(p in mods for p in parts) else None

    def _make_linear_hook(self, layer: int, parts: tuple[str, ...], sizes: list[int]):
        def hook(module, args, output):
            x = args[0]
            groups = self.token_groups(x.shape[0], x.device)
            out, bias = output if isinstance(output, tuple) else (output, None)
            if len(groups) == 1:
                mods = self._linear_mods(groups[0][0], layer, parts)
                if mods is None:
                    return output
                new = out + linear_delta(x, mods, parts, sizes, self.adapters[groups[0][0]].scale).to(out.dtype)
            else:
                delta = None
                for v, idx in groups:
                    mods = self._linear_mods(v, layer, parts)
                    if mods is None:
                        continue
                    if delta is None:
                        delta = out.new_zeros(*out.shape[:-1], sum(sizes), dtype=torch.float32)
                    delta[idx] = linear_delta(x[idx], mods, parts, sizes, self.adapters[v].scale)
                if delta is None:
                    return output
                new = out + delta.to(out.dtype)
            return (new, bias) if isinstance(output, tuple) else new
        return hook

    def _expert_lora(self, version: int | None, layer: int) -> ExpertLoRA | None:
        return self._loras.get(version, {}).get(layer) if version is not None else None

    def _moe_forward(self, layer: int):
        runtime = self

        def forward(block, hidden_states):
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1])
            logits, _ = block.gate(x)
            groups = runtime.token_groups(x.shape[0], x.device)
            lora = runtime._expert_lora(groups[0][0], layer) if len(groups) == 1 else None
            by_version = None if len(groups) == 1 else [(runtime._expert_lora(v, layer), idx) for v, idx in groups]
            # routing capture (capture.py) listens on vLLM's router, which this path bypasses: report to it
            out = routed_experts(x, logits, runtime._base_experts(layer), runtime.arch, lora,
                                 on_route=_router(block).capture_fn, groups=by_version)
            shared = _shared_expert(block)
            if shared is not None:
                out = out + shared(x)
            return out.reshape(shape)
        return forward

    # -- per-step versions (a step_hooks.py listener; registered by the worker extension in pin mode) -------
    def _tracked_id(self, internal: str) -> str | None:
        """The tracked request id of vLLM's internal one, None if nobody tracked it."""
        if internal in self.table.requests:
            return internal
        rid = external_id(internal)
        return rid if rid in self.table.requests else None

    def before(self, info) -> None:
        self._step = None
        if not self.table.requests or not info.req_ids:
            return
        newest = self.table.newest
        versions = []
        for internal in info.req_ids:
            rid = self._tracked_id(internal)
            versions.append(newest if rid is None else self.table.serving(rid))
        if any(v != newest for v in versions):
            self._step = TokenGroups(versions, info.query_start_loc)

    def after(self, info) -> None:
        self._step = None

    def token_groups(self, num_tokens: int, device) -> list:
        """[(version, token indices | None)] of the running forward; one group (None: all tokens) in the common
        case of every token on the newest version, and in forwards outside an engine step."""
        step = self._step
        return [(self.table.newest, None)] if step is None else step.groups(num_tokens, device)

    def salt(self, internal: str) -> str:
        """The cache salt of a request in the batch (prefix_routes.py): its tracked version's, else the untracked
        salt."""
        rid = self._tracked_id(internal)
        return UNTRACKED_SALT if rid is None else cache_salt(self.table.salt_version(rid))

    def live_salts(self) -> set[str]:
        """Salts whose prefix routes stay valid: the held versions' and the base model's."""
        return {cache_salt(v) for v in self.table.held} | {cache_salt(None)}

    def _adapted_layers(self) -> set[int]:
        return {li for loras in self._loras.values() for li in loras}

    def _set_moe_path(self, layers) -> None:
        """The plain-torch MoE forward on exactly these layers, vLLM's own on the others."""
        for li, block in self.blocks.items():
            if li in layers and "forward" not in block.__dict__:
                block.forward = types.MethodType(self._moe_forward(li), block)
            elif li not in layers and "forward" in block.__dict__:
                del block.forward

    # -- adapter versions ----------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        c = self.table.config
        check_inflight_config(mode, c.inflight, c.max_versions, c.on_full)
        if mode != self.mode and self.active is not None:
            raise ValueError(f"cannot switch the serving mode to {mode!r} while adapter version "
                             f"{self.active.version} is served in {self.mode!r} mode (moe_lora_clear first)")
        if mode != self.mode:                          # the other mode's copy of the base experts is not needed
            if self._merged_version is None:
                self._pristine, self._merged = {}, None
            self._base = {}
        self.mode = mode

    def set_expert_precision(self, precision: str) -> None:
        """The unmerged experts' GEMM precision (moe_torch.EXPERT_PRECISION); only while no adapter is served."""
        _check_precision(precision)
        if precision != self.expert_precision and self.active is not None:
            raise ValueError(f"cannot change the expert precision to {precision!r} while adapter version "
                             f"{self.active.version} is served (moe_lora_clear first)")
        if precision != self.expert_precision:
            self._base = {}
        self.expert_precision = precision

    def activate(self, adapter: AdapterSet, owner: str | None = None) -> dict:
        """Hold `adapter` as the newest version (switch: instead of the previous one; pin: beside the versions
        running requests use); returns timings. Nothing changes unless every step before the swap succeeded; an
        error inside the swap puts the held versions and MoE paths back (merged: not the merger's half-written
        weights)."""
        import time

        self.table.plan_admit(adapter.version, owner)   # stale, or pin and full: refused before any work
        t0 = time.perf_counter()
        kv_b = self._stage_kv_b(adapter)
        loras = {}
        for li, mods in adapter.layers.items():
            lora = stack_expert_lora(mods, self.arch, adapter.rank, adapter.scale, torch.float32)
            if lora is not None:
                if li not in self.blocks:
                    raise ValueError(f"adapter version {adapter.version}: expert factors for layer {li}, which has "
                                     "no routed experts in the served model")
                loras[li] = lora
                if self.mode == "merged":               # read base expert weights before switching
                    self._pristine_experts(li)
                else:
                    self._base_experts(li)
        undo = (self.table.snapshot(), dict(self.adapters), dict(self._loras), self._merged_version)
        try:                                           # the swap: on any error the previous version serves
            if self.mode == "merged":
                merger = self._merger()
                staged = merger.stage(loras)
                self._hold(adapter, {}, owner)
                merger.commit(staged)
                self._merged_version = adapter.version
                self._set_moe_path(())
            else:
                self._hold(adapter, loras, owner)
                self._set_moe_path(self._adapted_layers())
            if kv_b is not None:
                self._kv_b().commit(kv_b, merged=any(KV_B in m for m in adapter.layers.values()))
        except BaseException:
            self.table.restore(undo[0])
            self.adapters, self._loras, self._merged_version = undo[1], undo[2], undo[3]
            self._set_moe_path(self._adapted_layers())
            raise
        return {"commit_s": time.perf_counter() - t0}

    def _stage_kv_b(self, adapter: AdapterSet) -> dict | None:
        """The kv_b_proj weights to commit with this version (mla_merge.py), None when nothing changes there.
        Refused with pin: several versions in one batch cannot each have their own merged kv_b_proj."""
        deltas = {li: (*mods[KV_B], adapter.scale) for li, mods in adapter.layers.items() if KV_B in mods}
        if deltas and self.table.pin:
            raise ValueError(f"adapter version {adapter.version} adapts {KV_B} (layers {sorted(deltas)}), which vLLM's "
                             "absorbed MLA decode serves only merged, one version at a time; inflight='pin' holds "
                             "several versions in one batch: use inflight='switch' or leave kv_b_proj out of the "
                             "LoRA targets")
        if not deltas and (self._kvb is None or not self._kvb.merged):
            return None
        return self._kv_b().stage(deltas)

    def _hold(self, adapter: AdapterSet, loras: dict, owner: str | None = None) -> None:
        self._drop(self.table.admit(adapter.version, owner))
        self.adapters[adapter.version] = adapter
        self._loras[adapter.version] = loras

    def _drop(self, versions) -> None:
        for v in versions:
            self.adapters.pop(v, None)
            self._loras.pop(v, None)

    def track(self, requests: list) -> list:
        """[[request id, version | None], ...] -> the versions they run on (versions.VersionTable.track)."""
        return self.table.track(requests)

    def release(self, request_ids: list) -> list[int]:
        """The requests ended; returns the versions freed (pin)."""
        freed = self.table.release(request_ids)
        if freed:
            self._drop(freed)
            self._set_moe_path(self._adapted_layers())
        return freed

    def deactivate(self) -> None:
        self._drop(self.table.clear())                 # pin: refused while requests run on a held version
        if self._kvb is not None and self._kvb.merged:
            self._kvb.commit(self._kvb.stage({}), merged=False)
        if self._merged_version is not None:
            merger = self._merger()
            merger.commit(merger.stage({}))
            self._merged_version = None
        self._set_moe_path(())

    def status(self) -> dict:
        a = self.active
        return {"version": a.version if a else None, "checksum": a.checksum if a else None,
                "num_tensors": a.num_tensors if a else 0, "mode": self.mode, "expert_precision": self.expert_precision,
                **self.table.status()}
