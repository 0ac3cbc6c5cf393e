"""bf16 on CPU (megatron-core's local spec runs every op of these models in bf16 on CPU): parity with HF
transformers and layout-invariant LoRA training at tp2ep2 and pp2ep2, against fp32 references.

Tolerance (checks.tolerances.PARITY_BF16 = 8u, u = 2^-8 the unit roundoff of bf16's 8 significant bits): the metric is the
median over tokens of each token's max |logit diff|, relative to max |reference logit|. Every matmul output,
residual add and norm rounds to bf16, so a logit of magnitude |z| carries a few u*|z| of error (measured 2-4u in
parity); the median leaves out the few tokens whose top-k routing flips under bf16 rounding (0.5-1% of router
decisions), which move a token's logits by O(1) in HF transformers' own bf16 forward as well.
LoRA (3 AdamW steps at lr 3e-3, rank 4): a forward of the same adapters at another layout (checkpoint loaded across
layouts) stays within 8u. A model trained in bf16 gets 16u: the eval forward's 8u plus the rounding its adapters
carry (their gradients come from bf16 forwards/backwards with relative error of the same order, and Adam's
normalised update passes a relative gradient error on at about the same relative size). The loss of step k (a
forward of the model after k steps) gets (1+k)*8u relative. The base-vs-LoRA gap (fp32 LoRA logits vs the base's,
measured 0.04-0.08) is larger than every bf16 difference: bf16 training reproduces what LoRA changes.
Measured (glm4_moe / qwen3_moe tiny): trained tp2ep2 vs tp1 bf16 0.033 / 0.008, bf16 vs fp32 0.037 / 0.009,
loaded 0.017 / 0.006, losses within 1.3%.

R3 in bf16 (checks.tolerances.FIDELITY_TOL[bfloat16] = 16u): Megatron in bf16 replays forced routes (the rollout's and
a random valid set, padded and packed, at tp2ep2 and pp2ep2 in one launch) against HF transformers in fp32 forced to
the same routes (the fp32 reference: it isolates Megatron's bf16 error from the reference's). The rollout is HF
transformers bf16 standing in for vLLM (this module runs in both venvs; vLLM's routes are covered in fp32 by
tests/e2e/test_r3_vllm.py, and forced routes make the check independent of who chose them). Metric: the worst
token's max_v |logit diff| / max_v |reference logit| (fidelity_max_rel). Forced routes remove routing flips, so
unlike parity no token has to be left out and the maximum can be bounded: each token carries the few-u relative
error of parity's median (2-4u), and the worst of ~1.5k tokens per case sits a few times above it; 16u (the bound
of a bf16-trained model above) allows 4x over the median's 4u. The negative control (the rollout's routes shuffled
across tokens, against the rollout set's reference) must exceed 4 x 16u, and a run that is not bf16 at all is
caught by a lower bound of u/16 (fp32 Megatron is within 1e-4 absolute, ~1e-5 relative). The token dispatcher's
routing map must equal the rollout-format routes (0 mismatching tokens) and R3 must lower the KL to the rollout.
Measured (glm4_moe / qwen3_moe tiny, worst over layouts, padded/packed, both sets): 0.045 (11.6u) / 0.024 (6.2u),
max |logit diff| 0.70 / 0.43; shuffled 1.47 / 1.43.
"""
import pytest

from moe_lora_rl.checks.layouts import resolve_models
from moe_lora_rl.checks.lora_layouts import REFERENCE
from moe_lora_rl.checks.parity_run import run as run_parity, token_errors
from moe_lora_rl.checks.r3_run import run as run_replay
from moe_lora_rl.checks.tolerances import BF16_UNIT_ROUNDOFF, FIDELITY_TOL, PARITY_BF16 as TARGET_BF16, TRAINED_BF16
from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.megatron.run_config import RunConfig

pytestmark = pytest.mark.dist

BF16 = RunConfig(dtype="bf16")
LAYOUTS = ("tp2ep2", "pp2ep2")
LR = 3e-3
TRAINED = TRAINED_BF16


@pytest.fixture(scope="module")
def r3(tmp_path_factory):
    return run_replay(resolve_models(None), ",".join(LAYOUTS), tmp_path_factory.mktemp("r3_bf16"), engine="hf",
                      single_launch=True, rc=BF16)


def _r3_cases(res):
    for layout in LAYOUTS:
        for m, per in res[layout].items():
            for kind in ("padded", "packed"):
                yield (layout, m, kind), per[kind]


@pytest.mark.slow
def test_r3_replay_bf16_matches_forced_route_reference(r3):
    import torch

    tol = FIDELITY_TOL[torch.bfloat16]
    for where, r in _r3_cases(r3):
        rel = r["fidelity_max_rel"]
        worst = max(rel.values())
        assert BF16_UNIT_ROUNDOFF / 16 < min(rel.values()) and worst <= tol, (where, rel)
        assert r["shuffled_routes_rel"] > 4 * tol and worst < r["shuffled_routes_rel"], (where, r)
        assert all(n > 0 for n in r["dispatcher_tokens"].values()), (where, r)
        assert set(r["dispatcher_mismatched_tokens"].values()) == {0}, (where, r["dispatcher_mismatched_tokens"])
        assert r["kl_with"] < r["kl_without"], (where, r)


@pytest.mark.slow
def test_parity_bf16():
    models = resolve_models(None)
    res = run_parity(models, ",".join(LAYOUTS), BF16)
    assert res["metric"] == "rel_median_token" and res["target"] == TARGET_BF16
    for layout in LAYOUTS:
        for m, r in res["details"][layout].items():
            assert 0 <= r["rel_median_token"] <= TARGET_BF16, (layout, m, r)
            assert r["control"] > 4 * TARGET_BF16, (layout, m, r)     # the metric against shifted logits fails


def _lora_run(layouts, **kw):
    return lambda workdir: dict(models=resolve_models(None), layouts=",".join(layouts),
                                cfg=LoRAConfig(rank=4, alpha=8.0), workdir=workdir, lr=LR, **kw)


# in lockstep with the other LoRA layout runs (tests/conftest.py's lora_runs)
LORA_RUNS = {"lora_fp32_reference": {"fixture": "lora", "run": _lora_run((REFERENCE,))},
             "lora_bf16": {"fixture": "lora", "run": _lora_run((REFERENCE,) + LAYOUTS, rc=BF16)}}


@pytest.fixture(scope="module")
def lora(lora_runs):
    import torch

    models = resolve_models(None)
    (_, fp32), (rep, bf16) = lora_runs("lora_fp32_reference"), lora_runs("lora_bf16")
    blobs = {(d, lay, m): torch.load(work / f"{lay}-m{i}.pt") for i, m in enumerate(models)
             for d, work, lays in (("fp32", fp32, (REFERENCE,)), ("bf16", bf16, (REFERENCE,) + LAYOUTS)) for lay in lays}
    return models, rep, blobs


def rel(a, b) -> float:
    return token_errors(a, b)["rel_median_token"]


def test_lora_bf16_layout_invariant(lora):
    models, rep, blobs = lora
    for m in models:
        ref = blobs["bf16", REFERENCE, m]
        lost = rel(ref["base_logits"], ref["eval_logits"])          # negative control: the adapter left out
        assert lost > TARGET_BF16, (m, lost)
        for layout in LAYOUTS:
            r, got = rep["per_layout"][layout][m], blobs["bf16", layout, m]
            assert r["init_diff"] == 0.0 and r["only_adapters_trainable"], (layout, m, r)
            assert r["losses"][-1] < r["losses"][0], (layout, m, r["losses"])
            trained = rel(got["eval_logits"], ref["eval_logits"])
            assert trained <= TRAINED and trained < lost, (layout, m, trained, lost)
            assert rel(got["loaded_logits"], ref["eval_logits"]) <= TARGET_BF16, (layout, m)
            for k, (x, y) in enumerate(zip(got["losses"], ref["losses"])):
                assert abs(x - y) <= (1 + k) * TARGET_BF16 * abs(y), (layout, m, got["losses"], ref["losses"])


def test_lora_bf16_closer_to_fp32_than_the_lora_gap(lora):
    models, _, blobs = lora
    for m in models:
        fp32 = blobs["fp32", REFERENCE, m]
        gap = rel(fp32["eval_logits"], fp32["base_logits"])             # what 3 LoRA steps change (fp32)
        for layout in (REFERENCE,) + LAYOUTS:
            got = blobs["bf16", layout, m]
            err = rel(got["eval_logits"], fp32["eval_logits"])
            assert err <= TRAINED and err < gap, (layout, m, err, gap)
            for k, (x, y) in enumerate(zip(got["losses"], fp32["losses"])):
                assert abs(x - y) <= (1 + k) * TARGET_BF16 * abs(y), (layout, m, got["losses"], fp32["losses"])
