"""A user's override_transformer_config (verl's actor_rollout_ref.actor.megatron.override_transformer_config) read
into build_from_hf's arguments: verl's defaults change nothing, the MoE options we checked are honoured
(tests/distributed/test_moe_options.py), anything else is refused in one line naming the key, before any process
group. The shared expert's adapter under moe_shared_expert_overlap does no sequence-parallel communication of its
own (megatron-core's explicit comm does it)."""
import pytest

from moe_lora_rl.lora.sharding import rule_for
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.moe_options import KEY, transformer_overrides
from moe_lora_rl.megatron.run_config import RunConfig

CPU, TE = RunConfig(), RunConfig(device="cuda", dtype="bf16", layer_spec="te")
VERL_DEFAULTS = {"recompute_granularity": None, "recompute_modules": ["core_attn"], "recompute_method": None,
                 "recompute_num_layers": None, "attention_backend": "flash"}


def test_verl_defaults_change_nothing():
    assert transformer_overrides(VERL_DEFAULTS, Layout(tp=2, ep=2), CPU) == {}
    assert transformer_overrides(None, Layout(), CPU) == {}
    assert transformer_overrides({"moe_permute_fusion": False, "moe_router_fusion": False,
                                  "moe_token_dispatcher_type": "alltoall"}, Layout(), CPU) == \
        {"moe_token_dispatcher_type": "alltoall"}


def test_honoured():
    assert transformer_overrides({"moe_shared_expert_overlap": True}, Layout(tp=2), CPU) == \
        {"moe_shared_expert_overlap": True}
    assert transformer_overrides({"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}, Layout(etp=2),
                                 CPU) == {"grouped_experts": True}
    assert transformer_overrides({"moe_grouped_gemm": True}, Layout(), TE) == {}
    assert transformer_overrides({"moe_token_dispatcher_type": "allgather"}, Layout(tp=2, etp=2), CPU) == \
        {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}


@pytest.mark.parametrize("overrides, layout, rc, says", [
    ({"moe_permute_fusion": True}, Layout(), CPU, "moe_permute_fusion=True"),
    ({"moe_permute_fusion": True}, Layout(), TE, "moe_permute_fusion=True"),
    ({"moe_token_dispatcher_type": "flex"}, Layout(ep=2), CPU, "moe_token_dispatcher_type='flex'"),
    ({"moe_token_dispatcher_type": "alltoall_seq"}, Layout(), CPU, "moe_token_dispatcher_type='alltoall_seq'"),
    ({"moe_token_dispatcher_type": "allgather"}, Layout(ep=2), CPU, "moe_token_dispatcher_type='allgather'"),
    ({"moe_token_dispatcher_type": "allgather"}, Layout(pp=2), CPU, "moe_token_dispatcher_type='allgather'"),
    ({"moe_shared_expert_overlap": True, "moe_token_dispatcher_type": "allgather"}, Layout(), CPU,
     "moe_shared_expert_overlap=True"),
    ({"moe_shared_expert_overlap": True}, Layout(tp=2), TE, "moe_shared_expert_overlap=True"),
    ({"moe_grouped_gemm": False}, Layout(), TE, "moe_grouped_gemm=False"),
    ({"moe_use_legacy_grouped_gemm": True}, Layout(), CPU, "moe_use_legacy_grouped_gemm=True"),
    ({"moe_router_fusion": True}, Layout(), CPU, "moe_router_fusion=True"),
    ({"moe_expert_capacity_factor": 1.0}, Layout(), CPU, "moe_expert_capacity_factor=1.0"),
    ({"recompute_granularity": "full"}, Layout(), CPU, "recompute_method=None with recompute_granularity=full"),
    ({"num_layers": 3}, Layout(), CPU, "num_layers=3"),
])
def test_refused_in_one_line(overrides, layout, rc, says):
    with pytest.raises(ValueError) as e:
        transformer_overrides(overrides, layout, rc)
    assert str(e.value).startswith(f"{KEY}.{says}:") and "\n" not in str(e.value), str(e.value)


def test_shared_expert_overlap_rule():
    """Without overlap the shared expert's adapter gathers (fc1) / reduce-scatters (fc2) its rank-r activation over
    the sequence; with megatron's explicit comm it must not (the base's input is gathered already, its output is
    reduce-scattered after fc2), while the replicated factor's gradient is still summed over TP."""
    for kind, seq in (("column", "gather"), ("row", "scatter")):
        plain = rule_for(kind, expert=False, sequence_parallel=True, tp_size=2)
        overlap = rule_for(kind, expert=False, sequence_parallel=True, tp_size=2, explicit_comm=True)
        assert (plain.seq_comm, overlap.seq_comm) == (seq, None)
        assert (overlap.A, overlap.B) == (plain.A, plain.B)
        replicated = overlap.A if kind == "column" else overlap.B
        assert replicated.reduce == ("tp", "dp")
