"""Apply LoRA to a megatron-core GPTModel stage: plan every adapter first (pure checks), then attach all of them.

A failing check raises before anything is attached, so a model never carries a partial adapter set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..megatron.hf_load import offsets
from ..models.naming import MEGATRON, AdapterName
from .config import LoRAConfig, expand
from .grouped import (attach_grouped, attach_te_grouped, detach_grouped, te_virtual_expert_linears,
                      virtual_expert_linears)
from .layers import (FactorMeta, LoRAAdapter, adapter_factors, attach, delta_net_blocks, detach, make_factor,
                     section_major_rows)
from .sharding import LinearRule, rule_for

SHARED_GATE_REFUSAL = ("LoRA target 'shared_gate': the shared expert's sigmoid gate is a [1, hidden] Parameter that "
                       "megatron-core's SharedExpertMLP applies with F.linear inside its forward (no linear module to "
                       "adapt), and a rank-r adapter of a one-row weight holds more values than the weight; it stays "
                       "frozen: remove 'shared_gate' from targets")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AdapterPlan:
    module_name: str              # local megatron module name of the base linear
    target: str
    rule: LinearRule
    A: FactorMeta
    B: FactorMeta
    shared: tuple[bool, bool]     # (A, B) shared by all experts of the layer: one parameter, referenced per expert


def _parallel_kind(linear: nn.Module) -> str:
    """column | row | duplicated (a whole weight on every TP rank: MLA's down projections in the TE spec, which
    megatron builds as TELinear(parallel_mode='duplicated'))."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if hasattr(linear, "grouped"):                   # a per-expert linear inside a GroupedMLP
        return linear.kind
    if isinstance(linear, ColumnParallelLinear):
        return "column"
    if isinstance(linear, RowParallelLinear):
        return "row"
    mode = getattr(linear, "parallel_mode", "")      # Transformer Engine linears (megatron's TE wrappers)
    if mode in ("column", "row", "duplicated") and hasattr(linear, "weight"):
        return mode
    raise ValueError(f"LoRA supports megatron ColumnParallelLinear/RowParallelLinear bases, got {type(linear).__name__}")


def plan_adapters(model: nn.Module, cfg: LoRAConfig) -> list[AdapterPlan]:
    from megatron.core import parallel_state as ps

    mcfg = model.config
    if "router" in cfg.resolved_targets():
        raise ValueError("LoRA target 'router': adapting the router is not supported (the router stays frozen; "
                         "router replay relies on its logits); remove 'router' from targets")
    if "shared_gate" in cfg.resolved_targets():
        raise ValueError(SHARED_GATE_REFUSAL)
    off = offsets(model)                      # ValueError if the experts do not divide over EP
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size()}
    modules = dict(model.named_modules())
    for name, mod in list(modules.items()):
        if type(mod).__name__ == "GroupedMLP":
            modules.update(virtual_expert_linears(name, mod))
        elif type(mod).__name__ == "TEGroupedMLP":
            modules.update(te_virtual_expert_linears(name, mod))

    wanted = cfg.resolved_targets()
    plans: list[AdapterPlan] = []
    for name, mod in modules.items():
        aname = MEGATRON.find_megatron(name, off)
        if aname is None or aname.linear.target not in wanted:
            continue
        target = aname.linear.target
        kind = _parallel_kind(mod)
        gname, is_expert = aname.canonical, aname.linear.part == "expert"
        shared = cfg.expert_factors_shared(target) if is_expert else (False, False)
        group = "etp" if is_expert else "tp"
        t = sizes[group]
        explicit = not is_expert and bool(getattr(mod, "explicit_expert_comm", False))   # shared-expert overlap
        rule = rule_for(kind, expert=is_expert, sequence_parallel=bool(mcfg.sequence_parallel), tp_size=t,
                        shared_across_experts=shared, explicit_comm=explicit)
        w = mod.weight
        out_local, in_local = w.shape
        out_full = out_local * (t if kind == "column" else 1)
        in_full = in_local * (t if kind == "row" else 1)
        glu = bool(mcfg.gated_linear_unit) and len(aname.linear.hf) == 2      # fc1: gate and up
        blocks = _head_blocks(target, mcfg)
        r = cfg.rank

        def fname(factor: str, is_shared: bool) -> str:
            base = AdapterName(aname.linear, aname.layer, None).canonical if is_shared else gname
            return f"{base}.lora_{factor}"

        A = FactorMeta(fname("A", shared[0]), (r, in_full), rule.A.shard_dim, rule.A.group, rule.A.reduce,
                       target=target)
        if glu:
            b_shape = (2, out_full // 2, r)
        else:
            b_shape = (out_full // sum(blocks), sum(blocks), r) if blocks else (out_full, r)
        b_dim = None if rule.B.shard_dim is None else (1 if glu else 0)
        B = FactorMeta(fname("B", shared[1]), b_shape, b_dim, rule.B.group, rule.B.reduce, glu=glu, target=target,
                       blocks=blocks)
        plans.append(AdapterPlan(name, target, rule, A, B, shared))
    _check_explicit_targets(cfg, plans)
    if not plans:
        raise ValueError(f"LoRA targets {list(cfg.targets)} match no layer of this model")
    return plans


def _head_blocks(target: str, mcfg) -> tuple[int, ...]:
    """FactorMeta.blocks of a target's B: the delta-net's in_proj's (delta_net_blocks), () for every other linear."""
    if target != "linear_in":
        return ()
    return delta_net_blocks(mcfg.linear_key_head_dim, mcfg.linear_value_head_dim, mcfg.linear_num_key_heads,
                            mcfg.linear_num_value_heads)


def _check_explicit_targets(cfg: LoRAConfig, plans: list[AdapterPlan]) -> None:
    """A named target must match a layer on some pipeline stage (counted over the PP group, so every stage
    raises together instead of one stage hanging in a later collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not cfg.explicit:
        return
    counts = torch.tensor([sum(p.target in expand(t) for p in plans) for t in cfg.explicit],
                          dtype=torch.int64)
    if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(counts, group=ps.get_pipeline_model_parallel_group())
    unmatched = [t for t, c in zip(cfg.explicit, counts.tolist()) if c == 0]
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no layer of this model; "
                         f"matched: {sorted({p.target for p in plans})}")


def group_coords() -> tuple[dict, dict]:
    """This rank's index in, and the size of, each group a factor may be sharded over (FactorMeta.group)."""
    from megatron.core import parallel_state as ps

    ranks = {"tp": ps.get_tensor_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(), None: 0}
    sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
             None: 1}
    return ranks, sizes


def initial_factor(p: nn.Parameter, seed: int, a_init: str = "kaiming") -> torch.Tensor:
    """What apply_lora gives factor `p` under init seed `seed` (A: the seeded a_init draw, B: zeros), as a new
    tensor of p's local shape, dtype and device."""
    ranks, sizes = group_coords()
    meta = p.lora_meta
    init = a_init if meta.global_name.endswith("lora_A") else "zeros"
    return make_factor(meta, ranks[meta.group], sizes[meta.group], init=init, seed=seed, dtype=p.dtype,
                       device=p.device).data


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[AdapterPlan]:
    """Freeze the base, attach adapters per the plan. All-or-nothing."""
    from megatron.core import parallel_state as ps

    plans = plan_adapters(model, cfg)
    modules = dict(model.named_modules())
    if any(hasattr(m, "lora") for m in modules.values()):
        raise ValueError("model already has LoRA adapters attached")
    ranks, sizes = group_coords()
    dtype = _DTYPES[cfg.dtype]
    device = next(model.parameters()).device             # the adapters live where the base weights do
    shared: dict[str, nn.Parameter] = {}
    adapters = []
    for p in plans:                                     # build everything first; attach only if all succeeded
        facs = []
        for meta, init, is_shared in ((p.A, cfg.a_init, p.shared[0]), (p.B, "zeros", p.shared[1])):
            if is_shared:
                if meta.global_name not in shared:
                    shared[meta.global_name] = make_factor(meta, ranks[meta.group], sizes[meta.group], init=init,
                                                           seed=cfg.init_seed, dtype=dtype, device=device)
                facs.append((shared[meta.global_name], False))
            else:
                facs.append((make_factor(meta, ranks[meta.group], sizes[meta.group], init=init, seed=cfg.init_seed,
                                         dtype=dtype, device=device), True))
        (A, own_A), (B, own_B) = facs
        tp_group = ps.get_tensor_model_parallel_group() if p.rule.seq_comm else None
        order = None
        if p.B.blocks:
            heads = p.B.local_shape(sizes[p.B.group])[0] // sum(p.B.blocks)
            order = section_major_rows(p.B.blocks, heads).to(device)
        adapters.append((p, LoRAAdapter(p.rule, cfg.scale, cfg.dropout, A, B, own_A, own_B, tp_group, order)))
    for param in model.parameters():
        param.requires_grad_(False)
    holders: dict[str, nn.Module] = {}
    grouped: dict[str, dict[str, list]] = {}
    for p, adapter in adapters:
        experts_name, _, rest = p.module_name.partition(".local_experts.")
        if p.module_name in modules:
            attach(modules[p.module_name], adapter)
        else:                                            # (TE)GroupedMLP: collect per local expert, attach below
            grouped.setdefault(experts_name, {"linear_fc1": [], "linear_fc2": []})[rest.split(".")[1]].append(adapter)
        for fac, own in ((adapter.factor_A, "A" in adapter._parameters), (adapter.factor_B, "B" in adapter._parameters)):
            if not own:                                  # register a shared factor once, on its experts module
                experts_name = p.module_name.split(".local_experts.")[0]
                holder = holders.get(experts_name)
                if holder is None:
                    holder = holders[experts_name] = nn.Module()
                    modules[experts_name].lora_shared = holder
                key = fac.lora_meta.global_name.rsplit(".experts.", 1)[1].replace(".", "_")
                if key not in holder._parameters:
                    holder.register_parameter(key, fac)
    for experts_name, fcs in grouped.items():
        experts = modules[experts_name]
        if type(experts).__name__ == "TEGroupedMLP":
            attach_te_grouped(experts.linear_fc1, fcs["linear_fc1"])
            attach_te_grouped(experts.linear_fc2, fcs["linear_fc2"])
        else:
            attach_grouped(experts, fcs["linear_fc1"], fcs["linear_fc2"])
    for _, fac in adapter_factors(model):
        fac.requires_grad_(True)
    model.lora_config = cfg
    return plans


def remove_lora(model: nn.Module) -> None:
    for mod in list(model.modules()):
        if hasattr(mod, "_lora_hook"):
            detach(mod)
        if type(mod).__name__ == "GroupedMLP" and "forward" in mod.__dict__:
            detach_grouped(mod)
        if hasattr(mod, "lora_shared"):
            del mod.lora_shared
