"""Megatron = HF for the hybrid linear-attention family (megatron/hybrid_spec.py, megatron/hf_load_hybrid.py, cpu_support's
delta-rule binding): fp32 logits of the megatron-core model built from the tiny qwen3_5_moe checkpoint against
transformers' Qwen3_5MoeForCausalLM (its torch delta-rule and conv paths, its own routing) at tp1ep1pp1, tp2 (the
delta-net's key and value heads split over TP), ep2, pp2 and etp2; Qwen3-Next tiny and the released multimodal layout
(tiny_vl, read as its text tower) at tp1. One torchrun launch of 2 ranks (kit/hybrid_parity.py), shared with the other
2-rank jobs.

Tolerance: max |diff| <= 1e-4 (fp32 logits), as for the GQA and MLA families. The tiny checkpoints draw dt_bias as
Mamba does (models/tiny_hybrid.INIT_VERSION 2), so the per-token decays are of order -0.1; with version 1's (decays to
-44) the chunked delta rule's running sums lost fp32's precision and HF's own logits moved by 5e-4 under a half-ulp
change of its input. Each run records that sensitivity (hf_ulp) beside the difference.
Negative controls at tp1ep1pp1 (must exceed 100x the tolerance): the attention output gate's rows zeroed, every conv
kernel reversed, the layer pattern rolled by one (a checkpoint with its layers and layer_types rolled; the original
checkpoint loaded into a rolled pattern is refused by the loader, naming the missing tensor).
"""
import json

import pytest

pytestmark = pytest.mark.dist

TOL = 1e-4          # max |Megatron - HF| of fp32 logits

LAYOUTS = ("tp1ep1pp1", "tp2", "ep2", "pp2", "etp2")


def _models() -> dict:
    from moe_lora_rl.models import get_model

    return {"tiny": str(get_model("qwen3_5_moe", "tiny")), "tiny_vl": str(get_model("qwen3_5_moe", "tiny_vl")),
            "next": str(get_model("qwen3_next", "tiny"))}


def _args(workdir) -> list[str]:
    m = _models()
    cases = {layout: [m["tiny"]] for layout in LAYOUTS}
    cases["tp1ep1pp1"] += [m["next"], m["tiny_vl"]]
    return ["--cases", json.dumps(cases), "--controls", m["tiny"], "--workdir", str(workdir)]


LAUNCH = {"hybrid_parity": {"nproc": 2, "module": "kit.hybrid_parity", "args": _args}}


@pytest.fixture(scope="module")
def rep(shared_launch):
    got, _ = shared_launch("hybrid_parity")
    return got


def test_megatron_equals_hf_at_every_layout(rep):
    m = _models()
    par = rep["parity"]
    assert tuple(par) == LAYOUTS
    assert set(par["tp1ep1pp1"]) == set(m.values())
    for layout, per_model in par.items():
        for path, r in per_model.items():
            assert 0 <= r["max_abs"] <= TOL, (layout, path, r)
            assert r["ref_max_abs"] > 1.0 and r["hf_ulp"] > 0, (layout, path, r)
    # tp2 splits the delta-net's 4 value heads (and 2 key heads) over its ranks
    assert {k: r["delta_heads_local"] for k, r in ((k, par[k][m["tiny"]]) for k in LAYOUTS)} == \
        {"tp1ep1pp1": 4, "tp2": 2, "ep2": 4, "pp2": 4, "etp2": 4}


def test_negative_controls_fail_the_same_check(rep):
    c = rep["controls"]
    for name in ("gate_rows_zeroed", "conv_reversed", "pattern_rolled"):
        assert c[name] > 100 * TOL, (name, c)
    assert "lacks" in c["pattern_rolled_refused"] and "self_attn" in c["pattern_rolled_refused"], c
