"""The one sharding rule for LoRA factors, derived from the base linear (pure).

    column base (W: [out/t, in]):  A [r, in] replicated,        B [out/t, r] sharded like the base output
    row base    (W: [out, in/t]):  A [r, in/t] sharded like the input, B [out, r] replicated
    duplicated  (W: [out, in] on every rank, tokens as the base sees them): A, B replicated

MLA's down projections: linear_q_down_proj is a column base in the local spec (megatron splits its rows over TP and
gathers the output itself, after the hook, so B's row shard is exactly the base's); linear_kv_down_proj is duplicated
(build.py / cpu_support.duplicated_kv_down on the local spec, TELinear in the TE spec), as are both in the TE spec.

t is the base layer's tensor-parallel group: TP for attention / dense / shared-expert linears, expert-TP (ETP) for
routed experts. The replicated factor's gradient is a partial sum on each rank whenever the layer's tokens are split
or its partner factor is sharded, so it is all-reduced over that group:

    non-expert, sequence parallel: column A sees only the local sequence shard, row B the reduce-scattered one -> TP
    expert (explicit expert comm):  column A gets dh from a B shard, row B gets a partial h        -> ETP
    shared expert under moe_shared_expert_overlap (explicit comm, sequence parallel): as the expert case  -> TP

Every adapter factor is then all-reduced over its data-parallel replicas: the data-parallel group for non-expert
linears, the expert-data-parallel group for experts. Factors shared by several experts (shared_outer, shared
layouts) are also reduced over expert parallelism, because every EP rank holds a copy that sees its own experts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FactorRule:
    shard_dim: int | None         # dim of the (canonical 2D) factor split over `group`, None = replicated
    group: str | None             # "tp" | "etp" | None
    reduce: tuple[str, ...]       # process groups its gradient is all-reduced over, in order


@dataclass(frozen=True)
class LinearRule:
    parallel: str                 # "column" | "row"
    expert: bool
    A: FactorRule
    B: FactorRule
    # forward communication of the rank-r activation (non-expert with SP only):
    #   column: all-gather h along the sequence; row: reduce-scatter h along the sequence
    seq_comm: str | None


def rule_for(parallel: str, *, expert: bool, sequence_parallel: bool, tp_size: int,
             shared_across_experts: tuple[bool, bool] = (False, False), explicit_comm: bool = False) -> LinearRule:
    """parallel: the base layer's kind; shared_across_experts: (A shared, B shared) by all experts of a layer;
    explicit_comm: a non-expert base whose module leaves the sequence-parallel communication to its caller
    (megatron's explicit_expert_comm: the shared expert under moe_shared_expert_overlap gathers its input before fc1
    and reduce-scatters fc2's partial sums itself), so the adapter's rank-r activation is not communicated either."""
    if parallel not in ("column", "row", "duplicated"):
        raise AssertionError(f"base parallel kind {parallel!r}")
    group = "etp" if expert else "tp"
    dp = "edp" if expert else "dp"
    if not expert and tp_size > 1 and not sequence_parallel:
        raise ValueError("LoRA on tensor-parallel linears requires sequence parallelism (MoE with TP>1 needs it "
                         "anyway in megatron-core); set sequence_parallel=True")
    split_tokens = expert or sequence_parallel            # when the replicated factor sees partial sums
    reduce_replicated = ((group,) if split_tokens and tp_size > 1 else ())

    def factor(sharded: bool, dim: int, shared: bool) -> FactorRule:
        extra = ("ep",) if shared else ()
        if sharded:
            return FactorRule(dim if tp_size > 1 else None, group if tp_size > 1 else None, extra + (dp,))
        return FactorRule(None, None, reduce_replicated + extra + (dp,))

    a_shared, b_shared = shared_across_experts
    if parallel == "duplicated":
        A, B = factor(False, 1, a_shared), factor(False, 0, b_shared)
        return LinearRule(parallel, expert, A, B, None)
    if parallel == "column":
        A, B = factor(False, 1, a_shared), factor(True, 0, b_shared)
    else:
        A, B = factor(True, 1, a_shared), factor(False, 0, b_shared)
    seq = None if expert or explicit_comm or not sequence_parallel or tp_size == 1 else ("gather" if parallel == "column" else "scatter")
    return LinearRule(parallel, expert, A, B, seq)
