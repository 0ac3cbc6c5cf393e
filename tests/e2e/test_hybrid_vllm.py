"""vLLM's CPU engine on the hybrid linear-attention family (Qwen3.5-MoE tiny; its released layout with --all), fp32, against HF transformers with the
adapter merged (tests/kit/hybrid_serve.py, one engine, every check on it); HF = Megatron within 1e-4 on this family
is tests/distributed/test_hybrid_parity.py.

- base: prompt logprobs and greedy decode equal HF's through the fp32 delta-net core (vllm/gdn_torch.py); with it
  undone vLLM's CPU op refuses fp32 (negative control: "CPU GDN attention requires BF16.")
- every module group the engine adapts on this family, served merged and unmerged: the routed experts, the shared
  expert (behind its sigmoid gate), o_proj, and by vLLM module the delta-net's in_proj_qkvz / in_proj_ba / out_proj
  and the gated attention's qkv_proj (the targets lora/apply.py refuses in training until then): max |logprob diff|
  <= 1e-4 on prompt and decoded tokens, greedy tokens equal; each group moves the engine's and the reference's
  logprobs by > 1e-3; the all-modules adapter pushed without one group fails the check by > 1e-3 (a dropped module)
- R3: captured routes equal HF's router top-k at every token and MoE layer (linear and full layers), both modes
- chunked prefill: a 100-token prompt through a 32-token step budget (the conv and SSM state carried across chunks)
  equals HF under the all-modules adapter
- preemption: a 9-block KV pool makes vLLM preempt running requests (resumed by recompute: state dropped, tokens
  prefilled again); 8 greedy requests of 100 + 100 tokens under the all-modules adapter decode as HF does
- prefix caching (on: the engine has chunked prefill; vllm/hybrid_config.py): a request sharing a 200-token prefix with
  the previous one reads the cached block (128 tokens: its attention KV and the recurrent state at its end) and
  decodes as HF does

Tolerances as test_mla_vllm.py: 1e-4 is the same fp32 math in two implementations; k3 <= 1e-10 follows; prompt
positions 2e-4 (PROMPT_TOL: the reference's own fp32 sensitivity on this family).
"""
import pytest

from moe_lora_rl.checks.torchrun import run_process

pytestmark = pytest.mark.vllm
TOL, K3, MOVED = 1e-4, 1e-10, 1e-3
# prompt positions of the released layout's tiny: up to 1.13e-4 (the text tiny: 7.6e-5). These random tokens sit at
# log p ~ -10, and HF's own fp32 logits on this family move by up to 1.1e-4 under a half-ulp change of the input
# embeddings (the chunked delta rule's running sums; test_hybrid_parity.py's hf_ulp): the reference's own noise.
PROMPT_TOL = 2e-4
MODES = ("merged", "unmerged")


# CI runs the text checkpoint; the released layout (Qwen3_5MoeForConditionalGeneration, text_config, a vision tower and
# an MTP layer set aside, served as its text tower with no image or video input) and Qwen3-Next (in_proj_qkvz /
# in_proj_ba fused per key head, a dense layer) run with --all (slow): same checks.
@pytest.fixture(scope="module", params=[pytest.param(("qwen3_5_moe", "tiny"), id="text"),
                                        pytest.param(("qwen3_5_moe", "tiny_vl"), id="released", marks=pytest.mark.slow),
                                        pytest.param(("qwen3_next", "tiny"), id="next", marks=pytest.mark.slow)])
def result(request, tmp_path_factory):
    from moe_lora_rl.models import get_model

    return run_process("kit.hybrid_serve", ["--model", str(get_model(*request.param))], timeout=1800,
                       cwd=tmp_path_factory.mktemp("hybrid"), what="hybrid serving worker")


def test_fp32_base_matches_hf_and_vllm_kernel_refuses_fp32(result):
    b = result["base"]
    assert result["gdn_torch_layers"] == 3, result["gdn_torch_layers"]          # the tiny's three delta-net layers
    assert b["prompt_max"] <= PROMPT_TOL and b["decode_max"] <= TOL and b["greedy_equal"], b
    assert "CPU GDN attention requires BF16" in result["base_unfixed_error"], result["base_unfixed_error"]


@pytest.mark.parametrize("mode", MODES)
def test_every_module_served_exactly_and_moves_the_output(result, mode):
    rows = {k.split("/")[0]: v for k, v in result["served"].items() if k.endswith("/" + mode)
            and k.split("/")[0] not in ("chunked", "prefix")}
    assert set(rows) == set(result["groups"]) | {"all"}, rows.keys()
    assert {"experts", "shared_expert", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj", "qkv_proj"} <= set(rows)
    for name, r in rows.items():
        assert r["prompt_max"] <= PROMPT_TOL and r["decode_max"] <= TOL, (name, r)
        assert r["k3"] <= K3 and r["greedy_equal"], (name, r)
        assert r["engine_moved"] > MOVED and r["ref_moved"] > MOVED, (name, r)


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_module_fails_the_check(result, mode):
    for name in result["groups"]:
        assert result["dropped"][f"{name}/{mode}"] > MOVED, (name, mode, result["dropped"])


@pytest.mark.parametrize("mode", MODES)
def test_r3_routes_equal_hf_router(result, mode):
    assert result["served"][f"routes_{mode}"] == 1.0, result["served"]


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_exact(result, mode):
    r = result["served"][f"chunked/{mode}"]
    assert result["long_len"] > 2 * result["budget"]
    assert r["prompt_max"] <= PROMPT_TOL and r["decode_max"] <= TOL and r["greedy_equal"], r


@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_hit_exact(result, mode):
    r = result["served"][f"prefix/{mode}"]
    assert r["hit_tokens"] > 0, r
    assert r["decode_max"] <= TOL and r["greedy_equal"], r


def test_preempted_and_resumed_sequences_exact(result):
    r = result["preempted"]
    assert r["preemptions"] > 0, r                  # the small pool made vLLM preempt
    assert r["decode_max"] <= TOL and r["greedy_equal"], r
