"""Expert LoRA trains identically at every layout (fp32), on a batch where some expert gets an odd number of tokens
and some expert none; adapters saved at the unsharded layout load at every other layout.

Tolerances: 1e-5 on losses and gathered adapter tensors after 3 AdamW steps (lr 1e-4); the only differences are
fp32 reduction orders. Adam divides by the gradient's own magnitude, so for factors whose gradient is near zero that
noise becomes a fraction of lr per step (measured 1.4e-5 at lr 1e-3, ~1e-6 at lr 1e-4). 1e-4 on logits of magnitude
~10 (as in the parity test).
Regressions covered: one adapter per EP rank (EP-dependent numerics), silently wrong ETP>1, lost gradients for
experts with odd token counts, export by local expert index (every global expert id must be present).
"""

import pytest

from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS
from moe_lora_rl.checks.lora_layouts import REFERENCE
from moe_lora_rl.checks.tolerances import LORA_LAYOUT, LORA_LOGITS

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def work(lora_trained):
    return lora_trained[2]


@pytest.fixture(scope="module")
def report(lora_trained):
    return lora_trained[1]


def test_expert_load_is_uneven(report):
    for m, info in report["expert_load"].items():
        assert 0 in info["counts"] and any(c % 2 for c in info["counts"]), (m, info)


def test_equal_at_init_and_only_adapters_trainable(report):
    for layout, per in report["per_layout"].items():
        for m, r in per.items():
            assert r["init_diff"] == 0.0, (layout, m)
            assert r["only_adapters_trainable"], (layout, m)


def test_layout_invariant_training(report):
    assert set(report["per_layout"]) == set(DEFAULT_LAYOUTS.split(","))
    for layout, per in report["per_layout"].items():
        for m, r in per.items():
            assert r["losses"][-1] < r["losses"][0], (layout, m, r["losses"])      # it trains
            assert r["loss_max_diff"] <= LORA_LAYOUT, (layout, m, r)
            assert r["adapter_max_diff"] <= LORA_LAYOUT, (layout, m, r)
            assert r["eval_logits_max_diff"] <= LORA_LOGITS, (layout, m, r)


def test_checkpoint_loads_at_other_layouts(report):
    for layout, per in report["per_layout"].items():
        if layout == REFERENCE:
            continue
        for m, r in per.items():
            assert r["loaded_logits_max_diff"] <= LORA_LOGITS, (layout, m, r)


def test_every_global_expert_has_its_own_adapter(report, work):
    """The adapters gathered at ep4 name exactly fc1 and fc2, A and B, of every (MoE layer, global expert)."""
    import re

    import torch

    from moe_lora_rl.models.arch import load_arch

    for i, m in enumerate(report["per_layout"]["ep4"]):
        arch = load_arch(m)
        want = {(layer, e, fc, f) for layer, moe in enumerate(arch.moe_layers) if moe
                for e in range(arch.num_experts) for fc in ("linear_fc1", "linear_fc2") for f in "AB"}
        names = torch.load(work / f"ep4-m{i}.pt")["adapters"]
        got = {(int(x[1]), int(x[2]), x[3], x[4]) for x in
               (re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(linear_fc[12])\.lora_([AB])", n) for n in names) if x}
        assert got == want, (m, sorted(want - got)[:6], sorted(got - want)[:6])


# --- MLA (deepseek_v3): LoRA on every MLA linear besides the experts, shared expert and dense MLP -------------------
MLA_LAYOUTS = "tp2ep2,tp2ep2etp2,pp2ep2"          # tp2, ep2, pp2 and an etp layout against tp1ep1pp1
MLA_TARGETS = {"tiny": {"q_down", "q_up", "kv_down", "kv_up", "proj"}, "tiny_lite": {"q", "kv_down", "kv_up", "proj"}}


def _mla_run(tmp_path_factory, sizes, layouts):
    from moe_lora_rl.checks.lora_layouts import run
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.models import get_model

    models = [str(get_model("deepseek_v3", s)) for s in sizes]
    work = tmp_path_factory.mktemp("lora_mla")
    return models, run(models, layouts, LoRAConfig(rank=4, alpha=8.0), work, controls=True, peft=True), work


def _check_mla_peft(models, work, layout, capsys):
    """The adapter trained at `layout`, exported as the main job exports it (stream_to_peft, collective) and as the
    verl route's checkpoint is exported (checkpoint_to_peft), loads in HF transformers + peft on HF's DeepseekV3 with
    Megatron+LoRA's logits (fp32, PEFT_LOGITS); so does the merged checkpoint the export's warning points to (a
    kv_b_proj adapter is what vLLM's own LoRA drops: one line says so). Control: the exported kv_b_proj factor
    perturbed breaks the match."""
    import torch
    from safetensors.torch import load_file, save_file

    from moe_lora_rl.checks.hf import hf_logits
    from moe_lora_rl.checks.tolerances import PEFT_BROKEN_MIN, PEFT_LOGITS
    from moe_lora_rl.lora.peft_hf import peft_logits
    from moe_lora_rl.refit.export import checkpoint_to_peft
    from moe_lora_rl.refit.merged import save_merged

    data, figures = torch.load(work / "data.pt"), {}
    for i, m in enumerate(models):
        tokens, megatron = data[m]["eval"], torch.load(work / f"{layout}-m{i}.pt")["eval_logits"]
        main_job = work / f"peft-{layout}-m{i}"
        verl = checkpoint_to_peft(work / f"ckpt-{layout}-m{i}", m, work / f"verl-peft-{layout}-m{i}")
        said = [l for l in capsys.readouterr().err.splitlines() if "vLLM's own LoRA ignores" in l]
        assert len(said) == 1 and "kv_b_proj (4 layers)" in said[0] and "moe_lora_rl.refit.merged" in said[0], said
        for d in (main_job, verl):
            diff = (peft_logits(m, d, tokens) - megatron).abs().max().item()
            figures[d.name] = diff
            assert diff <= PEFT_LOGITS, (m, d, diff)
        merged = save_merged(m, main_job, work / f"merged-{layout}-m{i}")
        diff = (hf_logits(str(merged), tokens) - megatron).abs().max().item()
        figures[merged.name] = diff
        assert diff <= PEFT_LOGITS, (m, "merged", diff)
        t = load_file(str(main_job / "adapter_model.safetensors"))
        key = next(k for k in t if ".kv_b_proj.lora_B" in k)
        t[key] = t[key] + 1e-2
        save_file(t, str(main_job / "adapter_model.safetensors"))
        diff = (peft_logits(m, main_job, tokens) - megatron).abs().max().item()
        figures[f"{main_job.name} kv_b_proj perturbed"] = diff
        assert diff > PEFT_BROKEN_MIN, (m, "perturbed", diff)
    with capsys.disabled():                                     # the figures docs/mla.md quotes (pytest -s)
        print("max |logit diff| vs Megatron:", {k: f"{v:.2e}" for k, v in figures.items()})


def _check_mla(models, report, layouts, sizes):
    assert set(report["per_layout"]) == {REFERENCE} | set(layouts.split(","))
    for layout, per in report["per_layout"].items():
        for m, r in per.items():
            assert r["init_diff"] == 0.0 and r["only_adapters_trainable"], (layout, m)
            assert r["losses"][-1] < r["losses"][0], (layout, m, r["losses"])
            assert r["loss_max_diff"] <= LORA_LAYOUT and r["adapter_max_diff"] <= LORA_LAYOUT, (layout, m, r)
            assert r["eval_logits_max_diff"] <= LORA_LOGITS, (layout, m, r)
            if layout == REFERENCE:
                continue
            assert r["loaded_logits_max_diff"] <= LORA_LOGITS, (layout, m, r)
            size = sizes[models.index(m)]
            want = MLA_TARGETS["tiny_lite" if size == "tiny_lite" else "tiny"]
            drops = {k.split(":")[1] for k in r["controls"] if k.startswith("drop:")}
            assert want <= drops, (layout, m, sorted(drops))        # every MLA linear carries an adapter ...
            for k, v in r["controls"].items():                     # ... whose loss the comparison would see
                assert v > LORA_LOGITS, (layout, m, k, v)


@pytest.mark.slow
def test_mla_lora_layout_invariant_all_variants(tmp_path_factory):
    """LoRA (targets all: every MLA linear, experts, shared expert, dense MLP) trains identically at tp2, ep2, pp2
    and etp2 on the three MLA variants; negative controls: each target's adapters dropped, one factor perturbed."""
    sizes = ("tiny", "tiny_rope", "tiny_lite")
    models, report, _ = _mla_run(tmp_path_factory, sizes, MLA_LAYOUTS)
    _check_mla(models, report, MLA_LAYOUTS, sizes)


SMOKE_SIZES, SMOKE_LAYOUTS = ("tiny", "tiny_lite"), "tp2ep2,pp2ep2"


def _smoke_run(workdir):
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.models import get_model

    return dict(models=[str(get_model("deepseek_v3", s)) for s in SMOKE_SIZES], layouts=SMOKE_LAYOUTS,
                cfg=LoRAConfig(rank=4, alpha=8.0), workdir=workdir, controls=True, peft=True)


# in lockstep with the other LoRA layout runs (tests/conftest.py's lora_runs)
LORA_RUNS = {"lora_mla_smoke": {"fixture": "mla_smoke", "run": _smoke_run}}


@pytest.fixture(scope="module")
def mla_smoke(lora_runs):
    report, work = lora_runs("lora_mla_smoke")
    return _smoke_run(work)["models"], report, work


def test_mla_lora_layout_invariant_smoke(mla_smoke, capsys):
    """CI smoke of the above: both q_lora_rank variants at tp2ep2 and pp2ep2; the PEFT export of the tp2ep2 run in HF
    transformers + peft."""
    sizes, layouts = SMOKE_SIZES, SMOKE_LAYOUTS
    models, report, work = mla_smoke
    _check_mla(models, report, layouts, sizes)
    _check_mla_peft(models, work, "tp2ep2", capsys)


# --- the hybrid family (qwen3_5_moe; qwen3_next): LoRA on every linear, the delta-net's and the gated q_proj's too --
HYBRID_LAYOUTS = "tp2,ep2,pp2,etp2"                # tp2 splits the delta-net's key and value heads over its ranks
HYBRID_TARGETS = {"linear_in", "linear_out", "qkv", "proj", "shared_fc1", "shared_fc2", "expert_fc1", "expert_fc2"}


def _hybrid_run(workdir):
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.models import get_model

    return dict(models=[str(get_model("qwen3_5_moe", "tiny"))], layouts=HYBRID_LAYOUTS,
                cfg=LoRAConfig(rank=4, alpha=8.0), workdir=workdir, controls=True, peft=True)


def _hybrid_next_run(workdir):
    """Qwen3-Next (its delta-net inputs fused per key head in HF) at the reference layout and tp2."""
    from moe_lora_rl.lora import LoRAConfig
    from moe_lora_rl.models import get_model

    return dict(models=[str(get_model("qwen3_next", "tiny"))], layouts="tp2", cfg=LoRAConfig(rank=4, alpha=8.0),
                workdir=workdir, controls=True, peft=True)


LORA_RUNS.update({"lora_hybrid": {"fixture": "hybrid_lora", "run": _hybrid_run},
                  "lora_hybrid_next": {"fixture": "hybrid_lora", "run": _hybrid_next_run}})


@pytest.fixture(scope="module")
def hybrid_lora(lora_runs):
    return {name: lora_runs(name) for name in ("lora_hybrid", "lora_hybrid_next")}


def _print_hybrid(hybrid_lora) -> None:
    """The figures docs/models.md quotes (pytest -s)."""
    for name in hybrid_lora:
        for layout, per in hybrid_lora[name][0]["per_layout"].items():
            for r in per.values():
                print(name, layout, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in r.items()
                                     if k.endswith("diff") or k in ("grad_max_abs", "blocked_heads_local",
                                                                    "ref_logits_max_abs")},
                      {k: f"{v:.2e}" for k, v in r.get("controls", {}).items()})


def test_hybrid_lora_layout_invariant(hybrid_lora, capsys):
    """LoRA on every linear of Qwen3.5-MoE (targets all: the delta-net's in_proj and out_proj, the gated linear_qkv,
    o_proj, the shared expert, the routed experts) trains identically at tp2 (the delta-net's key heads, and
    in_proj's B with them, split over TP), ep2, pp2 and etp2; Qwen3-Next at tp2 alike.
    - the first step's adapter gradients, gathered to canonical names: max |diff| <= GRAD_SPLIT x the largest entry
      (the same batch split over other ranks: reduction order only);
    - losses and adapters after 3 AdamW steps: LORA_LAYOUT;
    - the reference's checkpoint loaded at each layout: the same canonical adapters bit for bit, and its logits
      within LAYOUT_LOGITS_REL of the reference's largest logit (the same adapters, another layout);
    - the eval logits of each layout's own trained adapters: LAYOUT_LOGITS_REL as well. This family's tiny models
      amplify fp32 noise ~100x (HF's own logits move by 0.5-1.1e-4 of ~21 under half an ulp of input,
      test_hybrid_parity.py), so adapters equal to 1.4e-6 give logits equal to ~1e-4 absolute, 8e-6 relative.
    Negative controls on the loaded adapters, the same logit comparison: each target's adapters dropped, one factor
    perturbed, and in_proj's B applied without its reordering to the rank's [q|k|v|z|b|a] rows (where that order
    differs: more than one key head on the rank)."""
    from moe_lora_rl.checks.tolerances import GRAD_SPLIT, LAYOUT_LOGITS_REL

    with capsys.disabled():
        _print_hybrid(hybrid_lora)
    for name, layouts in (("lora_hybrid", HYBRID_LAYOUTS), ("lora_hybrid_next", "tp2")):
        report, _ = hybrid_lora[name]
        assert set(report["per_layout"]) == {REFERENCE} | set(layouts.split(",")), name
        for layout, per in report["per_layout"].items():
            for m, r in per.items():
                rel = LAYOUT_LOGITS_REL * r["ref_logits_max_abs"]
                assert r["init_diff"] == 0.0 and r["only_adapters_trainable"], (layout, m)
                assert r["losses"][-1] < r["losses"][0], (layout, m, r["losses"])
                assert r["blocked_heads_local"] == (1 if layout == "tp2" else 2), (layout, m, r)   # 2 key heads
                for k in ("loss_max_diff", "adapter_max_diff"):
                    assert r[k] <= LORA_LAYOUT, (layout, m, k, r[k])
                assert r["grad_max_diff"] <= GRAD_SPLIT * r["grad_max_abs"], (layout, m, r)
                assert r["eval_logits_max_diff"] <= rel, (layout, m, r)
                if layout == REFERENCE:
                    continue
                assert r["loaded_adapter_max_diff"] == 0.0 and r["loaded_logits_max_diff"] <= rel, (layout, m, r)
                drops = {k.split(":")[1] for k in r["controls"] if k.startswith("drop:")}
                assert HYBRID_TARGETS <= drops, (layout, m, sorted(r["controls"]))
                assert ("rows:linear_in" in r["controls"]) == (layout != "tp2"), (layout, m, sorted(r["controls"]))
                for k, v in r["controls"].items():
                    assert v > rel and v > LORA_LOGITS, (layout, m, k, v)


def test_hybrid_lora_peft_export_in_hf(hybrid_lora, capsys):
    """Every layout's adapters, exported as the main job exports them (stream_to_peft: in_proj_qkv/_z/_b/_a each with
    in_proj's A and its own B rows, q_proj with HF's per-head [query, gate] rows, k_proj, v_proj; Qwen3-Next:
    in_proj_qkvz / in_proj_ba per key head), are bit for bit the whole-adapter export of that layout's gathered
    adapters (the TP/EP/PP streaming placement); the reference's export loads in HF transformers + peft on
    Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM with Megatron+LoRA's logits (PEFT_LOGITS). Control: one part's B
    zeroed (in_proj_z; Qwen3-Next: in_proj_ba) breaks the match. The tp2 export's HF figure is printed, not held to
    PEFT_LOGITS: its adapters trained at tp2 put the ill-conditioned tiny model 1.8e-4 from the reference's logits
    (see test_hybrid_lora_layout_invariant), and HF = Megatron there measured 1.9e-4."""
    import torch
    from safetensors.torch import load_file, save_file

    from moe_lora_rl.checks.tolerances import PEFT_LOGITS
    from moe_lora_rl.lora.peft_hf import peft_logits
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.refit.rename import to_peft_tensors

    figures = {}
    for name, part in (("lora_hybrid", "in_proj_z"), ("lora_hybrid_next", "in_proj_ba")):
        report, work = hybrid_lora[name]
        data = torch.load(work / "data.pt")
        m = next(iter(report["per_layout"][REFERENCE]))
        arch, tokens = load_arch(m), data[m]["eval"]
        for layout in report["per_layout"]:
            blob, d = torch.load(work / f"{layout}-m0.pt"), work / f"peft-{layout}-m0"
            t = load_file(str(d / "adapter_model.safetensors"))
            whole = to_peft_tensors(blob["adapters"], arch)
            assert t.keys() == whole.keys() and all(torch.equal(t[k], whole[k]) for k in t), (name, layout)
            modules = {k.split(".lora_")[0].split(".", 5)[-1] for k in t}
            want = {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"} if name.endswith("next") else \
                {f"linear_attn.in_proj_{p}" for p in ("qkv", "z", "b", "a")}
            assert want | {"linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj", "mlp.shared_expert.gate_proj", "mlp.experts.0.down_proj"} <= modules, \
                sorted(modules)
            if layout not in (REFERENCE, "tp2"):
                continue
            diff = (peft_logits(m, d, tokens) - blob["eval_logits"]).abs().max().item()
            figures[f"{name} {layout}"] = diff
            if layout != REFERENCE:
                continue
            assert diff <= PEFT_LOGITS, (m, layout, diff)
            key = next(k for k in t if f".{part}.lora_B" in k)
            t[key] = torch.zeros_like(t[key])
            save_file(t, str(d / "adapter_model.safetensors"))
            diff = (peft_logits(m, d, tokens) - blob["eval_logits"]).abs().max().item()
            figures[f"{name} {layout} {part} B zeroed"] = diff
            assert diff > PEFT_LOGITS, (m, layout, part, diff)
    with capsys.disabled():                                     # the figures docs/models.md quotes (pytest -s)
        print("max |logit diff| vs Megatron:", {k: f"{v:.2e}" for k, v in figures.items()})
