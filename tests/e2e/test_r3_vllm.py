"""R3 end to end on CPU: vLLM rollouts in bf16 with our routing capture; Megatron (fp32) replays them at every layout
(tp1ep1pp1, tp2ep2, tp2ep2etp2 with sequence parallelism, ep4, pp2ep2; one torchrun launch of 4 ranks), padded and
packed, on the tiny Qwen3-MoE model and the warm-started default (glm4_moe/wide: 128 experts, top-8 in 4 of 8
groups, routing as fragile as a real MoE's), and is checked against HF transformers forced to the same routes
(moe_lora_rl/checks/forced_routes.py, which shares no code with the alignment).

- fidelity: fp32 logits within 1e-4 on the tiny model (the parity bench's fp32 noise is ~3e-5; the packed reference
  uses the same rotary positions as the pack, see forced_routes.forced_logits); on the default model, whose logits
  reach ~33, the same noise relative to each token's largest logit within 1e-5. Forced sets: the rollout's routes and random valid
  routes; together at least 5% of their decisions are ones the fp32 router would not pick (bf16 flips alone are
  ~1%), so a replay that fell back to the router's own choice would fail.
- negative control: the rollout routes shuffled across tokens, replayed, differ from the reference by > 1e-2.
- dispatcher: the routing map megatron's token dispatcher receives equals the rollout-format routes of the rank's
  tokens (computed from token positions, not from the aligned tensors), padding included.
- the k3 KL to the rollout's logprobs drops with R3; router disagreement without replay is > 0.
- with an expert adapter served: the same engine serves a rank-8 expert adapter (gate and up sharing A, as
  Megatron's fused fc1 LoRA holds it) in each serving mode (unmerged: our batched experts; merged: vLLM's kernel on
  W + s*B@A) and captures the rollout's routes; Megatron at tp2ep2 and pp2ep2 with the same adapter imported into
  its LoRA (refit/import_peft.py) replays them against HF with the adapter merged forced to the same routes: the
  same fidelity bound, dispatcher and KL checks; negative controls: the shuffled routes, and the LoRA zeroed
  (Megatron without the adapter) replaying the same routes. The routes are the adapter's routing: far more of their
  decisions differ from the base model's routers' own choices than from the adapted routers'.
- MLA (`mla`): the same fidelity, dispatcher, KL and negative-control checks on a DeepSeek-V3-architecture checkpoint
  (deepseek_v3/tiny_rope: plain RoPE, where vLLM's CPU rotary kernel needs our fix, so the routes come from a bf16
  MLA engine with the fix applied; the MTP layer in the checkpoint), at tp1ep1pp1 and tp2ep2 (MLA's heads and
  latent projections split over TP), one launch of 2 ranks, no adapter (MLA adapters served: test_mla_vllm.py).
  And the bf16 engine itself: its logprobs against Megatron replaying its routes within bf16 rounding (k3 <=
  R3_BF16_K3, from the GQA families' figures; a rotary fault at positions > 0 is 100x that), the same logprobs against
  Megatron routing freely beyond it (the control). Marked slow: ~2 min on the shared 2-core machine.
"""
import pytest

from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS
from moe_lora_rl.checks.r3_run import run
from moe_lora_rl.checks.tolerances import FIDELITY_REL_FP32, FIDELITY_TOL, R3_BF16_K3, SHUFFLED_MIN

pytestmark = pytest.mark.vllm

LAYOUTS = DEFAULT_LAYOUTS.split(",")
KINDS = ("padded", "packed")
ADAPTER_MODES = ("unmerged", "merged")
ADAPTER_LAYOUTS = ("tp2ep2", "pp2ep2")


def models() -> list[str]:
    from moe_lora_rl.models import get_model
    from moe_lora_rl.data.warm_start import warm_started

    return [str(get_model("qwen3_moe", "tiny")), str(warm_started("glm4_moe", "wide"))]


MLA_LAYOUTS = ("tp1ep1pp1", "tp2ep2")


def mla_model() -> str:
    from moe_lora_rl.models import get_model

    return str(get_model("deepseek_v3", "tiny_rope"))


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run(models(), DEFAULT_LAYOUTS, tmp_path_factory.mktemp("r3"), engine="vllm",
               single_launch=True, adapter_modes=",".join(ADAPTER_MODES), adapter_layouts=",".join(ADAPTER_LAYOUTS))


@pytest.fixture(scope="module")
def mla_res(tmp_path_factory):
    return run([mla_model()], ",".join(MLA_LAYOUTS), tmp_path_factory.mktemp("r3_mla"), engine="vllm",
               single_launch=True)


# case -> (its module fixture, its layouts, models checked with the relative fp32 bound: logits above ~20)
CASES = {"gqa": ("res", LAYOUTS, lambda: {models()[1]}),
         "mla": ("mla_res", list(MLA_LAYOUTS), lambda: {mla_model()})}


@pytest.fixture(params=["gqa", pytest.param("mla", marks=pytest.mark.slow)])
def case(request):
    fixture, layouts, relative = CASES[request.param]
    return request.getfixturevalue(fixture), layouts, relative()


def _each(res, layouts=LAYOUTS):
    for layout in layouts:
        for m, per in res[layout].items():
            for kind in KINDS:
                yield (layout, m, kind), per[kind]


def test_replay_matches_forced_route_reference(case):
    """fp32: max |logit diff| <= 1e-4 on the tiny Qwen3-MoE model; on the default model, whose logits reach ~33,
    and the MLA model (~23), the same noise relative to each token's largest logit <= 1e-5
    (checks/tolerances.py)."""
    import torch

    res, layouts, relative = case
    for where, r in _each(res, layouts):
        for name, d in r["fidelity_max_diff"].items():
            if where[1] in relative:
                assert 0 <= r["fidelity_max_rel"][name] <= FIDELITY_REL_FP32, (where, name, r)
            else:
                assert 0 <= d <= FIDELITY_TOL[torch.float32], (where, name, r)


def test_shuffled_routes_differ(case):
    res, layouts, _ = case
    for where, r in _each(res, layouts):
        assert r["shuffled_routes_diff"] > SHUFFLED_MIN, (where, r)


def test_forced_routes_are_not_the_routers_own(case):
    res = case[0]
    for m, sets in res["forced_decisions"].items():
        bad = sum(b for b, _ in sets.values())
        tot = sum(t for _, t in sets.values())
        assert tot > 1000 and bad / tot >= 0.05, (m, sets)
        assert sets["rollout"][0] > 0, (m, sets)              # bf16 rollout routes the fp32 router would not pick


def test_dispatcher_receives_the_rollout_routes(case):
    res, layouts, _ = case
    for where, r in _each(res, layouts):
        for name in ("rollout", "random"):
            assert r["dispatcher_tokens"][name] > 0, (where, r)
            assert r["dispatcher_mismatched_tokens"][name] == 0, (where, name, r)


def test_kl_drops_with_replay(case):
    res, layouts, _ = case
    for where, r in _each(res, layouts):
        assert r["decisions"] > 1000, (where, r)
        assert r["disagreement_without"] > 0, (where, r)
        assert r["kl_with"] < r["kl_without"], (where, r)


@pytest.mark.slow
def test_mla_bf16_engine_within_rounding_with_replay(mla_res):
    """The bf16 MLA engine (plain RoPE, our rotary fix) against fp32 Megatron replaying its routes: k3 within bf16
    rounding at every layout and batch kind; against Megatron routing freely, beyond it (the control)."""
    for where, r in _each(mla_res, MLA_LAYOUTS):
        assert r["decisions"] > 1000, (where, r)
        assert 0 <= r["kl_with"] <= R3_BF16_K3, (where, r)
        assert r["kl_without"] > R3_BF16_K3, (where, r)


def _adapter(res):
    assert sorted(res["adapter"]) == sorted(ADAPTER_LAYOUTS), sorted(res["adapter"])
    for layout in ADAPTER_LAYOUTS:
        assert sorted(res["adapter"][layout]) == sorted(models())
        for m, per in res["adapter"][layout].items():
            for mode in ADAPTER_MODES:
                for kind in KINDS:
                    yield (layout, m, mode, kind), per[mode][kind], per


def test_adapter_served_routes_replay_with_the_adapter_in_megatron(res):
    import torch

    for where, r, per in _adapter(res):
        assert per[where[2]]["lora_factors_loaded"] > 0, where
        assert 0 <= r["fidelity_max_diff"]["rollout"] <= FIDELITY_TOL[torch.float32], (where, r)
        assert r["shuffled_routes_diff"] > SHUFFLED_MIN, (where, r)
        assert r["dispatcher_tokens"]["rollout"] > 0, (where, r)
        assert r["dispatcher_mismatched_tokens"]["rollout"] == 0, (where, r)
        assert r["decisions"] > 1000 and r["kl_with"] < r["kl_without"], (where, r)
        assert per["without_adapter_diff"] > SHUFFLED_MIN, (where, per["without_adapter_diff"])


def test_adapter_served_routes_are_the_adapters_routing(res):
    """The captured routes follow the adapted routers (bf16 vs fp32 near-ties aside) and not the base model's."""
    for m, modes in res["adapter_routes"].items():
        for mode in ADAPTER_MODES:
            (ad, tot), (base, tot_b) = modes[mode]["adapted_router_differs"], modes[mode]["base_router_differs"]
            assert tot > 1000 and tot_b > 1000, (m, mode, modes)
            assert ad / tot < 0.05 and base / tot_b > ad / tot + 0.1, (m, mode, modes)
