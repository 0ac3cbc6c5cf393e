"""Training checkpoints of the Megatron LoRA policy (fp32, 2 ranks, one torchrun launch per model): 2 AdamW steps,
save; fresh models load at the saving layout and at others -- adapters and Adam moments reshard -- and continue.
glm4_moe tiny (GQA): saved at tp2ep2, loaded at tp2ep2, tp1ep1pp1 (data parallel 2) and pp2 (each rank holds half
the layers). deepseek_v3 tiny (MLA; LoRA on every linear, q_a/q_b/kv_a/kv_b/o included): saved at tp1ep1pp1,
loaded at tp1ep1pp1, tp2ep2 (the MLA heads and the latent up-projections split over TP) and pp2. qwen3_5_moe tiny
(hybrid; LoRA on every linear, the delta-net's in_proj/out_proj and the gated q_proj included): saved at tp2 (the
delta-net's key heads, and in_proj's B with them, split over TP), loaded at tp2, tp1ep1pp1 and pp2.

Tolerances: the loaded adapters, Adam moments and step counts equal the saved ones exactly (gathered). The next step
from the loaded state: at the saving layout exactly the uninterrupted run's (0 difference); at the other layouts
within 1e-6 (adapters) and 1e-6 relative (losses ~18: fp32 reduction order differs between layouts, one ulp is 1.9e-6).
Negative control at both layouts: the same checkpoint loaded without the optimizer state (fresh AdamW) is off by
>1e-5 after one step, so the equality above needs the moments.
"""
import pytest

pytestmark = pytest.mark.dist


# (model, saving layout, the other layouts it is loaded at; the saving layout is loaded too)
CASES = {"glm4_moe": ("glm4_moe/tiny", "tp2ep2", ("tp1ep1pp1", "pp2")),
         "deepseek_v3": ("deepseek_v3/tiny", "tp1ep1pp1", ("tp2ep2", "pp2")),
         "qwen3_5_moe": ("qwen3_5_moe/tiny", "tp2", ("tp1ep1pp1", "pp2"))}


def _argv(case):
    model, save, others = CASES[case]
    return lambda out: ["--out", str(out), "--model", model, "--save-layout", save,
                        "--load-layouts", ",".join((save, *others))]


# each case in one launch with the other 2-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {f"ckpt_{case}": {"nproc": 2, "module": "kit.checkpoint_worker", "param": case,
                           "args": _argv(case)} for case in CASES}


@pytest.fixture(scope="module", params=sorted(CASES))
def report(request, shared_launch):
    _, save, others = CASES[request.param]
    got, out = shared_launch(f"ckpt_{request.param}")
    rep = dict(got)
    rep.update(root=out / "ckpt", save=save, others=others)
    return rep


def test_checkpoint_files(report):
    step = report["root"] / "step-00000002"
    assert (report["root"] / "latest").read_text().strip() == step.name
    names = sorted(p.name for p in step.iterdir())
    assert names == ["adapter-00000.safetensors", "adapter-00001.safetensors", "lora_config.json", "manifest.json",
                     "optim-00000.safetensors", "optim-00001.safetensors", "optimizer.json", "state-00000.pt",
                     "state-00001.pt"], names


def test_loaded_state_equals_saved(report):
    assert report["saved_steps"] == [2.0] and set(report["per_layout"]) == {report["save"], *report["others"]}
    for layout, r in report["per_layout"].items():
        assert r["state_step"] == 2 and r["state_rank_ok"], (layout, r)
        assert r["steps"] == [2.0] and r["lr"] == 1e-4, (layout, r)
        for k in ("adapter_diff", "exp_avg_diff", "exp_avg_sq_diff"):
            assert r[k] == 0.0, (layout, k, r)


def test_next_step_equals_uninterrupted(report):
    same = report["per_layout"][report["save"]]
    assert same["loss3_diff"] == 0.0 and same["after3_diff"] == 0.0 and same["loss4_diff"] == 0.0, same
    loss = report["losses"][-1]
    for layout in report["others"]:
        other = report["per_layout"][layout]
        assert other["after3_diff"] <= 1e-6, (layout, other)
        assert other["loss3_diff"] <= 1e-6 * loss and other["loss4_diff"] <= 1e-6 * loss, (layout, other)


def test_without_optimizer_state_diverges(report):
    for layout, r in report["per_layout"].items():
        assert r["no_opt_adapter_diff"] == 0.0, (layout, r)                # the same weights were loaded
        assert r["no_opt_after3_diff"] > 1e-5 and r["no_opt_after3_diff"] > 100 * r["after3_diff"], (layout, r)
        assert r["no_opt_loss4_diff"] > 1e-5 * report["losses"][-1], (layout, r)
