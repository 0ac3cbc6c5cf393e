"""R3 end to end on CPU: vLLM rollouts in bf16 with our routing capture; Megatron (fp32) replays them at every layout
(tp1ep1pp1, tp2ep2, tp2ep2etp2 with sequence parallelism, ep4, pp2ep2; one torchrun launch of 4 ranks), padded and
packed, on both tiny models, and is checked against HF transformers forced to the same routes
(moe_lora_rl/testing/forced_routes.py, which shares no code with the alignment).

- fidelity: fp32 logits within 1e-4 (the parity bench's fp32 noise is ~3e-5; the packed reference uses the same
  rotary positions as the pack, see forced_routes.forced_logits). Forced sets: the rollout's routes and random valid
  routes; together at least 5% of their decisions are ones the fp32 router would not pick (bf16 flips alone are
  ~1%), so a replay that fell back to the router's own choice would fail.
- negative control: the rollout routes shuffled across tokens, replayed, differ from the reference by > 1e-2.
- dispatcher: the routing map megatron's token dispatcher receives equals the rollout-format routes of the rank's
  tokens (computed from token positions, not from the aligned tensors), padding included.
- the k3 KL to the rollout's logprobs drops with R3; router disagreement without replay is > 0.
"""
import pytest

from moe_lora_rl.bench.common import DEFAULT_LAYOUTS, resolve_models
from moe_lora_rl.bench.replay_check import FIDELITY_TOL, SHUFFLED_MIN, run

pytestmark = pytest.mark.vllm

LAYOUTS = DEFAULT_LAYOUTS.split(",")
KINDS = ("padded", "packed")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run(resolve_models(None), DEFAULT_LAYOUTS, tmp_path_factory.mktemp("r3"), engine="vllm",
               single_launch=True)


def _each(res):
    for layout in LAYOUTS:
        for m, per in res[layout].items():
            for kind in KINDS:
                yield (layout, m, kind), per[kind]


def test_replay_matches_forced_route_reference(res):
    import torch

    for where, r in _each(res):
        for name, d in r["fidelity_max_diff"].items():
            assert 0 <= d <= FIDELITY_TOL[torch.float32], (where, name, r)


def test_shuffled_routes_differ(res):
    for where, r in _each(res):
        assert r["shuffled_routes_diff"] > SHUFFLED_MIN, (where, r)


def test_forced_routes_are_not_the_routers_own(res):
    for m, sets in res["forced_decisions"].items():
        bad = sum(b for b, _ in sets.values())
        tot = sum(t for _, t in sets.values())
        assert tot > 1000 and bad / tot >= 0.05, (m, sets)
        assert sets["rollout"][0] > 0, (m, sets)              # bf16 rollout routes the fp32 router would not pick


def test_dispatcher_receives_the_rollout_routes(res):
    for where, r in _each(res):
        for name in ("rollout", "random"):
            assert r["dispatcher_tokens"][name] > 0, (where, r)
            assert r["dispatcher_mismatched_tokens"][name] == 0, (where, name, r)


def test_kl_drops_with_replay(res):
    for where, r in _each(res):
        assert r["decisions"] > 1000, (where, r)
        assert r["disagreement_without"] > 0, (where, r)
        assert r["kl_with"] < r["kl_without"], (where, r)
