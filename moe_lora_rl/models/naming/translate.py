"""Naming: one model family's tensor names translated between every system that touches them (pure: no torch,
megatron or vLLM import).

    HF          model.layers.{L}.mlp.experts.{E}.gate_proj.weight          (checkpoint, transformers)
    Megatron    decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1 (this rank's stage and experts)
    canonical   layers.{L}.mlp.experts.{E}.linear_fc1.lora_A                 (global adapter factor)
    PEFT        base_model.model.model.layers.{L}.mlp.experts.{E}.gate_proj.lora_A.weight
    vLLM        model.layers.{L}.mlp.experts.w13_weight, expert E, slice 0   (fused modules: slice = output part)

{L} / {E}: global layer and expert; {l} / {e}: local to a pipeline stage / expert-parallel rank (offsets.py). A
family module builds one `Naming` from the rows of tables.py (adding a family = one module + one registry row). Every
lookup that fails raises ValueError naming the tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .offsets import Offsets
from .tables import HF_LAYER, MEGATRON_LAYER, PEFT_PREFIX, Linear, ParamRow, dims


def _template_regex(template: str) -> re.Pattern:
    pat = re.escape(template)
    for key in "lLeE":
        pat = pat.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
    return re.compile("^" + pat + "$")


def _fill(template: str, layer: int | None = None, expert: int | None = None, *, local: bool = False) -> str:
    lk, ek = ("{l}", "{e}") if local else ("{L}", "{E}")
    out = template if layer is None else template.replace(lk, str(layer))
    return out if expert is None else out.replace(ek, str(expert))


@dataclass(frozen=True)
class Resolved:
    row: ParamRow
    hf_names: tuple[str, ...]
    global_layer: int | None
    global_expert: int | None


@dataclass(frozen=True)
class AdapterName:
    """One adaptable linear at a global layer (and expert); expert None on an expert linear = shared by all."""
    linear: Linear
    layer: int
    expert: int | None

    @property
    def canonical(self) -> str:
        if self.linear.part != "expert":
            return f"layers.{self.layer}.{self.linear.canonical}"
        if self.expert is None:
            return f"layers.{self.layer}.{self.linear.canonical.replace('{E}.', '')}"
        return f"layers.{self.layer}.{_fill(self.linear.canonical, expert=self.expert)}"

    def hf_module(self, part: int) -> str:
        """The HF module of an output part, under model.layers.L."""
        return _fill(self.linear.hf[part], expert=self.expert)


@dataclass(frozen=True)
class VllmName:
    module: str                   # model.layers.L.<vllm module>
    expert: int | None            # row of a fused expert parameter
    slice: int                    # output part of a fused module (q/k/v, gate/up)


class Naming:
    def __init__(self, family: str, params: tuple[ParamRow, ...], linears: tuple[Linear, ...],
                 peft_fused_experts: bool = False):
        """peft_fused_experts: HF PEFT does not move this family's per-expert targets onto transformers 5's fused
        expert parameters itself (refit/export.py names them)."""
        self.family, self.params, self.linears = family, params, linears
        self.peft_fused_experts = peft_fused_experts
        self._params = [(r, _template_regex(r.megatron)) for r in params]
        self._by_target = {li.target: li for li in linears}
        self._megatron = [(li, _template_regex(MEGATRON_LAYER + li.megatron)) for li in linears]
        self._canonical = [(li, _template_regex("layers.{L}." + li.canonical)) for li in linears]
        self._canonical_shared = [(li, _template_regex("layers.{L}." + li.canonical.replace("{E}.", "")))
                                  for li in linears if li.part == "expert"]
        self._hf = [(li, i, _template_regex(HF_LAYER + h)) for li in linears for i, h in enumerate(li.hf)]
        self._vllm: dict[str, list[tuple[int, int, Linear]]] = {}       # vLLM module -> (slice, HF part, linear)
        for li in linears:
            for part in range(len(li.hf)):
                module, sl = li.vllm_slot(part)
                self._vllm.setdefault(module, []).append((sl, part, li))
        for vname, slots in self._vllm.items():
            if len({sl for sl, _, _ in slots}) < len(slots):
                raise AssertionError(f"{family}: linears {[li.target for _, _, li in slots]} overlap in vLLM module "
                                     f"{vname}")
        self._hf_params = [(r, i, _template_regex(h)) for r in params for i, h in enumerate(r.hf)
                           if not r.kind.startswith("grouped_")]

    # -- weights: HF <-> Megatron ------------------------------------------------------------------------------
    def resolve(self, megatron_name: str, offsets: Offsets) -> Resolved:
        """HF sources of a local Megatron parameter."""
        for row, pat in self._params:
            m = pat.match(megatron_name)
            if not m:
                continue
            gl = int(m["l"]) + offsets.layer if "l" in m.groupdict() else None
            ge = int(m["e"]) + offsets.expert if "e" in m.groupdict() else None
            names = tuple(h.replace("{L}", str(gl)).replace("{E}", str(ge) if ge is not None else "{E}")
                          for h in row.hf)
            return Resolved(row, names, gl, ge)
        raise ValueError(f"{self.family}: no HF name known for Megatron parameter {megatron_name!r}")

    def megatron_param(self, hf_name: str, offsets: Offsets) -> tuple[str, int]:
        """(local Megatron parameter, index of this tensor among its HF sources) on the rank with `offsets`."""
        for row, i, pat in self._hf_params:
            m = pat.match(hf_name)
            if m:
                d = m.groupdict()
                name = _fill(row.megatron, int(d["L"]) - offsets.layer if "L" in d else None,
                             int(d["E"]) - offsets.expert if "E" in d else None, local=True)
                return name, i
        raise ValueError(f"{self.family}: no Megatron parameter known for HF tensor {hf_name!r}")

    def _param_row(self, megatron_suffix: str) -> ParamRow:
        return next(r for r in self.params if r.megatron.endswith(megatron_suffix))

    def expert_weights(self, layer: int, expert: int) -> tuple[str, str, str]:
        """HF names of a routed expert's (gate, up, down) weights."""
        fc1 = self._param_row("local_experts.{e}.linear_fc1.weight").hf
        fc2 = self._param_row("local_experts.{e}.linear_fc2.weight").hf
        return tuple(h.replace("{L}", str(layer)).replace("{E}", str(expert)) for h in fc1 + fc2)

    def router_weights(self, layer: int) -> tuple[str, str | None]:
        """HF names of a MoE layer's router weight and expert bias (None if the family has none)."""
        bias = [r for r in self.params if r.megatron.endswith("mlp.router.expert_bias")]
        name = lambda r: r.hf[0].replace("{L}", str(layer))  # noqa: E731
        return name(self._param_row("mlp.router.weight")), name(bias[0]) if bias else None

    def expert_modules(self, expert: int) -> tuple[str, str, str]:
        """HF modules (under model.layers.L.) of a routed expert's (gate, up, down) projections."""
        return tuple(_fill(h, expert=expert) for t in ("expert_fc1", "expert_fc2") for h in self.linear(t).hf)

    # -- adapters: Megatron modules <-> canonical <-> PEFT <-> vLLM ----------------------------------------------
    def linear(self, target: str) -> Linear:
        if target not in self._by_target:
            raise ValueError(f"{self.family}: unknown LoRA target {target!r}; known {sorted(self._by_target)}")
        return self._by_target[target]

    def find_megatron(self, module: str, offsets: Offsets) -> AdapterName | None:
        """A local Megatron module (decoder.layers.l....) -> its global adapter name; None if not adaptable."""
        for li, pat in self._megatron:
            m = pat.match(module)
            if m:
                e = int(m["e"]) + offsets.expert if li.part == "expert" else None
                return AdapterName(li, int(m["l"]) + offsets.layer, e)
        return None

    def from_megatron(self, module: str, offsets: Offsets) -> AdapterName:
        found = self.find_megatron(module, offsets)
        if found is not None:
            return found
        raise ValueError(f"{self.family}: Megatron module {module!r} is not an adaptable linear")

    def to_megatron(self, name: AdapterName, offsets: Offsets) -> str:
        if name.expert is None and name.linear.part == "expert":
            raise ValueError(f"{name.canonical}: a factor shared by all experts has no single Megatron module")
        return _fill(MEGATRON_LAYER + name.linear.megatron, name.layer - offsets.layer,
                     None if name.expert is None else name.expert - offsets.expert, local=True)

    def parse_canonical(self, factor: str) -> tuple[AdapterName, str]:
        """layers.L.<module>.lora_A|B -> (adapter name, "A" | "B")."""
        module, sep, ab = factor.rpartition(".lora_")
        if sep and ab in ("A", "B"):
            for li, pat in self._canonical:
                m = pat.match(module)
                if m:
                    return AdapterName(li, int(m["L"]), int(m["E"]) if "E" in m.groupdict() else None), ab
            for li, pat in self._canonical_shared:
                m = pat.match(module)
                if m:
                    return AdapterName(li, int(m["L"]), None), ab
        raise ValueError(f"{self.family}: adapter tensor {factor!r} is not a canonical factor "
                         "layers.L.<module>.lora_A|B of a known linear")

    def hf_modules(self, name: AdapterName) -> tuple[str, ...]:
        """HF modules (model.layers.L. ...) of an adapter, in output order; per expert ids for a shared factor are
        the caller's (see peft_names)."""
        return tuple(HF_LAYER.replace("{L}", str(name.layer)) + name.hf_module(i) for i in range(len(name.linear.hf)))

    def peft_names(self, name: AdapterName, ab: str, num_experts: int) -> list[tuple[str, int]]:
        """PEFT tensor names a canonical factor becomes, each with its output part (a B factor of a fused module
        is split; A is shared by the parts; a factor shared by all experts is given to every expert)."""
        experts = range(num_experts) if name.linear.part == "expert" and name.expert is None else [name.expert]
        out = []
        for e in experts:
            for i, h in enumerate(self.hf_modules(AdapterName(name.linear, name.layer, e))):
                out.append(("base_model.model." + h + f".lora_{ab}.weight", i))
        return out

    def parse_peft(self, peft_name: str) -> tuple[AdapterName, int, str]:
        """PEFT tensor name -> (adapter name, output part, "A" | "B")."""
        if peft_name.startswith("base_model.model.") and peft_name.endswith(".weight"):
            module, sep, ab = peft_name[len("base_model.model."):-len(".weight")].rpartition(".lora_")
            if sep and ab in ("A", "B"):
                try:
                    name, part = self.parse_hf_module(module)
                except ValueError:
                    raise ValueError(f"{self.family}: adapter tensor {peft_name!r}: no module "
                                     f"{module.split('.', 3)[-1]!r} is adaptable in this family") from None
                return name, part, ab
        raise ValueError(f"{self.family}: adapter tensor {peft_name!r} is not a PEFT LoRA name "
                         f"({PEFT_PREFIX}layers.L.<module>.lora_A|B.weight)")

    def parse_hf_module(self, module: str) -> tuple[AdapterName, int]:
        """model.layers.L.<hf module> -> (adapter name, output part)."""
        for li, i, pat in self._hf:
            m = pat.match(module)
            if m:
                return AdapterName(li, int(m["L"]), int(m["E"]) if "E" in m.groupdict() else None), i
        raise ValueError(f"{self.family}: {module!r} is not an adaptable HF module of this family")

    def to_vllm(self, name: AdapterName, part: int) -> VllmName:
        """The vLLM module and output slice of an HF output part (Linear.vllm_slot)."""
        if name.linear.part == "expert" and name.expert is None:
            raise ValueError(f"{name.canonical}: a factor shared by all experts has no single vLLM slot")
        module, sl = name.linear.vllm_slot(part)
        return VllmName(f"model.layers.{name.layer}.{module}", name.expert, sl)

    def from_vllm(self, v: VllmName) -> tuple[AdapterName, int]:
        """(adapter name, output part of its linear) of a vLLM module slice."""
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", v.module)
        for sl, part, li in (self._vllm.get(m.group(2), []) if m else []):
            if (li.part == "expert") == (v.expert is not None) and sl == v.slice:
                return AdapterName(li, int(m.group(1)), v.expert), part
        raise ValueError(f"{self.family}: vLLM module {v} is not an adaptable module of this family")

    def vllm_linears(self) -> dict[str, tuple[str, ...]]:
        """vLLM module (under model.layers.L.) -> the HF modules of all its output slices in order, for the
        non-expert linears (a fused module may hold several linears: MLA's fused_qkv_a_proj = q_a_proj,
        kv_a_proj_with_mqa; a linear may span several modules: the delta-net's in_proj_qkvz / in_proj_ba)."""
        out = {}
        for vname, slots in self._vllm.items():
            if slots[0][2].part != "expert":
                out[vname] = tuple(li.hf[part] for _, part, li in sorted(slots, key=lambda s: s[0]))
        return out

    # -- shapes ------------------------------------------------------------------------------------------------
    def hf_shapes(self, arch, layer: int) -> dict[str, tuple[int, int]]:
        """(in, out) of every adaptable HF module (under model.layers.L.) of a layer; experts with {E}."""
        d, out = dims(arch), {}
        for li in self.layer_linears(arch, layer):
            ins, outs = li.io
            out_parts = outs.split("|")
            for i, h in enumerate(li.hf):
                out[h] = (d[ins], d[out_parts[i] if len(out_parts) > 1 else outs])
        return out

    def layer_linears(self, arch, layer: int) -> list[Linear]:
        """The linears a layer of this architecture has."""
        moe = arch.moe_layers[layer]
        types = getattr(arch, "layer_types", ())
        mixer = "attention" if not types or types[layer] == "full_attention" else "linear_attention"
        return [li for li in self.linears
                if not ((li.part == "dense" and moe) or (li.part in ("expert", "shared") and not moe)
                        or (li.part == "shared" and not arch.shared_expert_ffn)
                        or (li.part in ("attention", "linear_attention") and li.part != mixer))]
