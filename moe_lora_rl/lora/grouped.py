"""Per-expert LoRA on the legacy GroupedMLP (weight1/weight2 shared by all local experts, grouped GEMM).

The experts module gets an instance-level forward (scoped to that module, removed by remove_lora) that adds the
adapters through the same grouped GEMM op the base uses (grouped_gemm on GPU, cpu_support.torch_gmm on CPU):

    fc1 = gmm(x, W1) + s * gmm(gmm(x, A1^T), B1^T)    act(fc1) * probs    fc2 = gmm(h, W2) + s * gmm(gmm(h, A2^T), B2^T)

Factors are the same per-expert canonical tensors as on SequentialMLP, so checkpoints and exports interchange.
"""
from __future__ import annotations

import types

import torch
from torch import nn


class GroupedAdapters(nn.Module):
    def __init__(self, fc1: list, fc2: list):
        super().__init__()
        self.fc1 = nn.ModuleList(fc1)
        self.fc2 = nn.ModuleList(fc2)

    @staticmethod
    def delta(adapters: nn.ModuleList, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        A = torch.stack([a.factor_A for a in adapters])            # [E, r, in]
        B = torch.stack([a.factor_B for a in adapters])            # [E, out, r]
        h = gg.ops.gmm(adapters[0].dropout(x).to(A.dtype), A, tokens_per_expert, trans_b=True)
        return gg.ops.gmm(h, B, tokens_per_expert, trans_b=True) * adapters[0].scale


def _forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    x, probs = permuted_local_hidden_states, permuted_probs
    if self.config.moe_apply_probs_on_input:
        x = (probs.unsqueeze(-1) * x).to(x.dtype)
        probs = torch.ones_like(probs)
    if int(tokens_per_expert.sum()) == 0:
        return x.new_zeros(0, self.config.hidden_size), None
    w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
    w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
    fc1 = gg.ops.gmm(x, w1, tokens_per_expert, trans_b=False)
    fc1 = fc1 + GroupedAdapters.delta(self.lora.fc1, x, tokens_per_expert).to(fc1.dtype)
    inter = self.activation_func_with_probs(fc1, probs.unsqueeze(-1))
    fc2 = gg.ops.gmm(inter, w2, tokens_per_expert, trans_b=False)
    fc2 = fc2 + GroupedAdapters.delta(self.lora.fc2, inter, tokens_per_expert).to(fc2.dtype)
    return fc2, None


def attach_grouped(experts: nn.Module, fc1: list, fc2: list) -> None:
    experts.lora = GroupedAdapters(fc1, fc2)
    experts.forward = types.MethodType(_forward, experts)


def detach_grouped(experts: nn.Module) -> None:
    del experts.forward
    del experts.lora


def virtual_expert_linears(name: str, experts: nn.Module) -> dict:
    """The per-expert fc1/fc2 a GroupedMLP stands for, named as SequentialMLP names them."""
    from types import SimpleNamespace

    e, h = experts.num_local_experts, experts.config.hidden_size
    fc1_out = experts.weight1.shape[1] // e
    fc2_in = experts.weight2.shape[0] // e
    out = {}
    for i in range(e):
        out[f"{name}.local_experts.{i}.linear_fc1"] = SimpleNamespace(kind="column", weight=SimpleNamespace(
            shape=(fc1_out, h)), grouped=name)
        out[f"{name}.local_experts.{i}.linear_fc2"] = SimpleNamespace(kind="row", weight=SimpleNamespace(
            shape=(h, fc2_in)), grouped=name)
    return out


# --- TEGroupedMLP (Transformer Engine grouped linears, GPU only) --------------------------------------------------
# linear_fc1 / linear_fc2 are TEColumnParallelGroupedLinear / TERowParallelGroupedLinear with weight0..weight{E-1}
# and forward(x, m_splits) -> (out, bias). The adapter is a forward hook on each grouped linear that splits the
# tokens by m_splits and applies expert i's factors to its rows; names and factors are the SequentialMLP ones.

def te_virtual_expert_linears(name: str, experts: nn.Module) -> dict:
    from types import SimpleNamespace

    out = {}
    for fc, kind in (("linear_fc1", "column"), ("linear_fc2", "row")):
        lin = getattr(experts, fc)
        for i in range(lin.num_gemms):
            w = getattr(lin, f"weight{i}")
            out[f"{name}.local_experts.{i}.{fc}"] = SimpleNamespace(kind=kind, weight=SimpleNamespace(shape=w.shape),
                                                                    grouped=name, te_linear=f"{name}.{fc}")
    return out


def _te_hook(module, args, kwargs, output):
    x = args[0]
    m_splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    out, bias = output
    parts = [a(xi) for a, xi in zip(module.lora, torch.split(x, list(m_splits)))]
    return out + torch.cat(parts, dim=0).to(out.dtype), bias


def attach_te_grouped(linear: nn.Module, adapters: list) -> None:
    linear.lora = nn.ModuleList(adapters)
    linear._lora_hook = linear.register_forward_hook(_te_hook, with_kwargs=True)
