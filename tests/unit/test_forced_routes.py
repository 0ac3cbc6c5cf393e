"""The forced-route reference (HF transformers with given top-k ids) and the dispatcher's expected routes.

The reference is what Router Replay is checked against, so it is checked itself: forced to the routers' own choice
it reproduces HF's forward bit for bit (both routing families: softmax with top-k renormalisation; sigmoid with
expert bias, group-limited selection and routed scaling); forced to other routes it does not. expected_rows, computed
from token positions, agrees with the alignment code on padded + sequence-parallel and packed batches, and a
reversed token order does not."""
import numpy as np
import pytest
import torch

from moe_lora_rl.models import FAMILIES, get_model
from moe_lora_rl.checks.dispatch_capture import expected_rows, map_to_ids
from moe_lora_rl.checks.forced_routes import check_routes, forced_logits, moe_gates, reference_model


@pytest.fixture(scope="module", params=FAMILIES)
def hf(request):
    return reference_model(str(get_model(request.param)))


def _own_routes(model, tokens):
    got = {}
    gates = moe_gates(model)
    hooks = [g.register_forward_hook(lambda m, a, o, j=j: got.__setitem__(j, o[2])) for j, g in enumerate(gates)]
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, np.stack([got[j].numpy() for j in range(len(gates))], axis=1)


def test_forced_to_own_routes_reproduces_hf(hf):
    tokens = torch.randint(0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    ref, own = _own_routes(hf, tokens)
    logits, chosen = forced_logits(hf, tokens, own)
    assert torch.equal(logits, ref) and np.array_equal(chosen, own)
    assert all("forward" not in g.__dict__ for g in moe_gates(hf))           # the scoped forward is gone
    other = (own + 1) % moe_gates(hf)[0].num_experts                           # every decision moved
    moved, chosen = forced_logits(hf, tokens, other)
    assert (moved - ref).abs().max() > 1e-2
    assert np.array_equal(chosen[:, 0], own[:, 0])       # the first MoE layer sees the same inputs: same own choice


def test_routes_that_do_not_fit_the_model_are_refused(hf):
    gates = moe_gates(hf)
    k, e, n = gates[0].top_k, gates[0].num_experts, len(gates)
    ok = np.tile(np.arange(k), (5, n, 1))
    check_routes(gates, ok, 5)
    with pytest.raises(ValueError, match="routes cover 5 tokens, the sample has 6"):
        check_routes(gates, ok, 6)
    with pytest.raises(ValueError, match=f"routes for {n + 1} MoE layers, the model has {n}"):
        check_routes(gates, np.tile(np.arange(k), (5, n + 1, 1)), 5)
    with pytest.raises(ValueError, match=f"routes with top-k {k + 1}, the model routes to {k} experts per token"):
        check_routes(gates, np.tile(np.arange(k + 1), (5, n, 1)), 5)
    bad = ok.copy()
    bad[2, 0, 0] = e
    with pytest.raises(ValueError, match=f"expert id {e} is out of range 0..{e - 1}"):
        check_routes(gates, bad, 5)
    bad[2, 0, 0] = bad[2, 0, 1]
    with pytest.raises(ValueError, match="token 2, MoE layer 0: expert ids .* repeat an expert"):
        check_routes(gates, bad, 5)


def test_expected_rows_agree_with_alignment_and_catch_reversal():
    from moe_lora_rl.router_replay.align import align_microbatch
    from moe_lora_rl.router_replay.routes import RoutesBatch

    rng = np.random.default_rng(0)
    e, k, lengths = 16, 4, [6, 3, 5]
    samples = [np.argsort(rng.random((n, 2, e)), -1)[..., :k] for n in lengths]
    routes = RoutesBatch(samples, (1, 3), e, k)
    for padded_len, tp in ((6, 2), (None, 1), (8, 1)):
        for rank in range(tp):
            sp = dict(tp_rank=rank, tp_size=tp, sequence_parallel=tp > 1)
            aligned = align_microbatch(routes, [0, 1, 2], padded_len=padded_len, stage_layers=[3], **sp)[0]
            want = expected_rows(samples, 1, lengths, padded_len=padded_len, num_experts=e, **sp)
            assert np.array_equal(np.sort(aligned.numpy(), -1), want), (padded_len, tp, rank)
            assert not np.array_equal(np.sort(aligned.numpy()[::-1], -1), want)


def test_map_to_ids():
    m = torch.zeros(3, 6, dtype=torch.bool)
    m[0, [1, 4]] = True
    m[1, [0, 5]] = True
    m[2, [2]] = True                                          # a token with one expert instead of two
    assert map_to_ids(m, 2).tolist() == [[1, 4], [0, 5], [-1, -1]]


def test_rollout_that_does_not_fit_the_model_is_refused():
    from moe_lora_rl.checks.r3_run import check_rollout
    from moe_lora_rl.router_replay.routes import RoutesBatch

    path = str(get_model("glm4_moe"))                       # MoE layers 1, 2, 3; 16 experts; top-k 4
    def rollout(layers=(1, 2, 3), e=16, k=4, n=5, tokens=5):
        routes = RoutesBatch([np.zeros((n, len(layers), k), dtype=np.int64)], layers, e, k)
        return {"routes": routes.to_field(), "num_experts": e, "tokens": torch.zeros(1, tokens, dtype=torch.long)}
    check_rollout(rollout(), path)
    with pytest.raises(ValueError, match=r"routes for layers \(0, 1, 2\), the model's MoE layers are \(1, 2, 3\)"):
        check_rollout(rollout(layers=(0, 1, 2)), path)
    with pytest.raises(ValueError, match="routes over 32 experts, the model has 16"):
        check_rollout(rollout(e=32), path)
    with pytest.raises(ValueError, match="routes with top-k 2, the model's is 4"):
        check_rollout(rollout(k=2), path)
    with pytest.raises(ValueError, match=r"routes cover \[5\] tokens per sample, the samples have 6"):
        check_rollout(rollout(tokens=6), path)
