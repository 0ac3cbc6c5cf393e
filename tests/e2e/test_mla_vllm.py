"""vLLM's CPU engine on DeepSeek-V3-architecture (MLA) checkpoints against HF transformers, fp32
(tests/kit/mla_serve.py, one engine per checkpoint, every check on it):

- three checkpoints: plain RoPE with q_lora_rank set, plain RoPE with it null (Moonlight), yarn as Kimi-K2's
- plain RoPE: prompt logprobs (positions > 0) and greedy decode equal HF's with our rotary fix (vllm/rope_fix.py);
  with the fix undone they differ (negative control: the CPU rotary kernel misreads MLA's 3-D strided q)
- a checkpoint without topk_method / scoring_func in config.json (as HF's save_pretrained writes it) is served with
  DeepSeek-V3's values, with one line saying so
- LoRA on each MLA linear alone (five with q_lora_rank set, four with it null), on the routed experts, on the shared
  expert, and on all at once, served merged and unmerged: max |logprob diff| <= 1e-4 and k3 <= 1e-10 against HF with
  the adapter merged, on prompt positions and on decoded tokens (kv_b_proj's delta must reach the absorbed decode),
  greedy tokens equal; each adapter moves the engine's and the reference's logprobs by > 1e-3 (a module the engine
  dropped would agree with the base model instead)
- R3: captured routes equal HF's router top-k at every token and layer, while serving every module
- kv_b_proj's delta reaches decode only through the re-derived W_UK_T / W_UV: the check unties them from
  kv_b_proj.weight's storage first (an fp32 engine shares it, by accident); with the re-derivation disabled the
  decoded tokens' logprobs differ (negative control) while prefill still matches
- kv_b_proj is served merged (W_UK_T / W_UV re-derived per version): a kv_b_proj adapter on an engine holding several
  versions per batch (inflight='pin') is refused in one line, the served version unchanged

The Megatron trainer as the engine's reference (the adapters a run trained and pushed, the rollout's routes
replayed, at tp1ep1pp1, tp2 and ep2): tests/e2e/test_train_families.py.

Tolerances: 1e-4 is the same fp32 math in two implementations (measured ~2e-5); k3 <= 1e-10 follows (k3 ~ d^2 / 2),
over the decoded tokens as the trainer's k3 (over the random prompt tokens too it is ~1e-10 already without an
adapter: they sit at log p ~ -10, where fp32 logits carry larger absolute errors).
"""
import json
import shutil
import subprocess
import sys

import pytest

from moe_lora_rl.checks.torchrun import worker_env

pytestmark = pytest.mark.vllm
TOL, K3, MOVED = 1e-4, 1e-10, 1e-3


def _without_routing_keys(src, dst):
    """A copy of a checkpoint whose config.json lacks topk_method / scoring_func (as HF's save_pretrained leaves it)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    conf = json.loads((src / "config.json").read_text())
    conf.pop("topk_method", None), conf.pop("scoring_func", None)
    (dst / "config.json").write_text(json.dumps(conf))
    return dst


# CI runs the plain-RoPE checkpoint with q_lora_rank set (the rotary fault, all five MLA linears); the Moonlight and
# Kimi-K2 (yarn) variants run with --all (slow). The first checkpoint of each run lacks the routing keys.
@pytest.fixture(scope="module", params=[pytest.param(("tiny_rope",), id="rope"),
                                        pytest.param(("tiny_lite", "tiny"), id="lite-yarn", marks=pytest.mark.slow)])
def result(request, tmp_path_factory):
    from moe_lora_rl.models import get_model

    tmp = tmp_path_factory.mktemp("mla")
    first, *rest = request.param
    models = [str(_without_routing_keys(get_model("deepseek_v3", first), tmp / f"{first}_hf_config"))]
    models += [str(get_model("deepseek_v3", size)) for size in rest]
    proc = subprocess.run([sys.executable, "-m", "kit.mla_serve", "--models", ",".join(models)],
                          env=worker_env(), cwd=tmp, capture_output=True, text=True, timeout=1800)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout


def test_missing_routing_keys_filled_with_one_line(result):
    _, stdout = result
    said = [l for l in stdout.splitlines() if l.startswith("moe_lora: config.json has no topk_method / scoring_func")]
    assert len(said) == 1, stdout[-2000:]


def test_plain_rope_matches_hf_and_unfixed_path_does_not(result):
    for m in result[0]["models"]:
        b, u = m["base"], m["base_unfixed"]
        assert b["prompt_max"] <= TOL and b["decode_max"] <= TOL and b["greedy_equal"], b
        if m["rope_type"] == "default":
            assert m["rope_routed"] >= 1, m
            assert max(u["prompt_max"], u["decode_max"]) > 1e-2, u      # negative control: the kernel's fault
        else:                                   # yarn (Kimi-K2's): no CPU rotary kernel, nothing routed, right as is
            assert m["rope_routed"] == 0 and u == b, m


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_every_module_served_exactly(result, mode):
    for m in result[0]["models"]:
        rows = {k.split("/")[0]: v for k, v in m["served"].items() if k.endswith("/" + mode)}
        want = {"q_b_proj", "q_a_proj"} if m["q_lora_rank"] else {"q_proj"}
        want |= {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts", "shared_expert", "all"}
        assert set(rows) == want, rows.keys()
        for name, r in rows.items():
            assert r["prompt_max"] <= TOL and r["decode_max"] <= TOL, (m["model"], name, r)
            assert r["k3"] <= K3 and r["greedy_equal"], (m["model"], name, r)
            assert r["engine_moved"] > MOVED and r["ref_moved"] > MOVED, (m["model"], name, r)


@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_r3_routes_equal_hf_router(result, mode):
    for m in result[0]["models"]:
        assert m["served"][f"routes_{mode}"] == 1.0, m["served"]


def test_unmerged_kv_b_with_several_versions_per_batch_is_refused(result):
    for m in result[0]["models"]:
        r = m["pin_kv_b_refused"]
        assert "self_attn.kv_b_proj" in r["message"] and "inflight='pin'" in r["message"], r
        assert r["served_after"] == r["served_before"], r


def test_kv_b_without_reabsorbing_is_wrong_in_decode(result):
    for m in result[0]["models"]:
        r = m["kv_b_not_reabsorbed"]
        assert r["prompt_max"] <= TOL and r["decode_max"] > 1e-2, r
