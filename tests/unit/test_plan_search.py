"""The layout planner: memory sums against a hand-computed toy model, Kimi-K2 at the scale of Mind Lab's
trillion-parameter LoRA RL (r128 per-expert LoRA on 64 x 80 GB), and bad input (does not fit, staleness 0 with
async, GPU counts no layout divides) as one-line errors, from the CLI without a traceback."""
import json
import subprocess
import sys

import pytest

from moe_lora_rl.plan import Hardware, RLSettings, load_hardware, load_model, plan
from moe_lora_rl.plan.search import rollout_memory, train_memory
from moe_lora_rl.plan.specs import KIMI_K2_CONFIG, spec_from_config
from moe_lora_rl.plan.refit_calc import SPECS, expert_adapter_params, other_adapter_params

TOY = spec_from_config("toy", {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                               "num_key_value_heads": 2, "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 3, "vocab_size": 16}, "test")


def test_toy_spec_by_hand():
    # experts 2 layers * 4 * 3*8*3 = 576; routers 2*4*8 = 64; attention 2 * 4 * 8*8 = 512; norms 2*2*8 + 8 = 40;
    # embeddings 2 * 16*8 = 256
    assert TOY.total_params == 576 + 64 + 512 + 40 + 256 == 1448
    assert TOY.expert_params == 576 and TOY.dense_params == 872
    assert TOY.active_params == 1448 - 2 * 2 * 72                   # 2 of 4 experts idle per layer
    assert TOY.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2             # K+V, 2 layers, 2 heads of 4, bf16


def test_toy_memory_by_hand():
    rl = RLSettings(batch=4, prompt_len=2, response_len=2, rank=2)
    m = train_memory(TOY, Hardware(), rl, tp=1, etp=1, ep=2, pp=1, dp=2, train_weight_bytes=2)
    # expert adapters 2 layers * 4 * r2 (2*8 + 3*3) = 400; attention adapters 2 * 4 * r2 (8 + 8) = 256
    assert m["weights"] * 1e9 == pytest.approx(576 * 2 / 2 + 872 * 2)                  # experts over EP2
    assert m["adapters"] * 1e9 == pytest.approx(400 * 6 / 2 + 256 * 6)                 # bf16 + fp32 grad
    assert m["optimizer"] * 1e9 == pytest.approx(400 * 12 / 2 + 256 * 12 / 2)         # edp 1; dense DP 2
    # 1 in flight x 2 layers x s4 h8 x 2 bytes = 128; working 4 * (15*8 + 16 + 2*(16+12+6)) = 816;
    # fp32 logits 4 * 16 * 4 = 256
    assert m["activations"] * 1e9 == pytest.approx(128 + 816 + 256)
    assert m["total"] * 1e9 == pytest.approx(2320 + 2736 + 3936 + 1200)
    r = rollout_memory(TOY, Hardware(), rl, g=2, tp=1, rollout_weight_bytes=2)
    assert r["weights"] * 1e9 == pytest.approx(576 + 1744) and r["adapters"] * 1e9 == pytest.approx(400 + 512)


def test_presets_match_the_refit_calculator_and_published_sizes():
    k, q = load_model("kimi-k2"), load_model("qwen3-30b-a3b")
    assert k.moe == SPECS["kimi-k2"] and q.moe == SPECS["qwen3-30b-a3b"]
    assert 32.0e9 < k.active_params < 33.5e9          # "32B activated" (Kimi-K2 model card)
    assert 3.2e9 < q.active_params < 3.5e9            # "3.3B activated" (Qwen3-30B-A3B model card)
    assert k.mla and k.weight_bytes == 1 and q.weight_bytes == 2
    # negative control: a config that disagrees with the calculator's shapes is refused
    with pytest.raises(ValueError, match="refit calculator"):
        spec_from_config("kimi-k2", {**KIMI_K2_CONFIG, "n_routed_experts": 256}, "test", SPECS["kimi-k2"])


@pytest.fixture(scope="module")
def kimi():
    return plan(load_model("kimi-k2"), Hardware(), RLSettings(rank=128, adapter_layout="per_expert"), 64)


def test_kimi_k2_r128_fits_on_64_x_80gb(kimi):
    p = kimi.to_dict()
    calc = expert_adapter_params(SPECS["kimi-k2"], 128, "per_expert") + other_adapter_params(SPECS["kimi-k2"], 128)
    assert p["adapter"]["params"] == calc and round(calc / 1e9, 1) == 61.1
    t, r = p["training"], p["rollout"]
    assert t["gpus"] + r["gpus"] == 64
    assert t["memory_GB"]["total"] <= t["memory_GB"]["budget"] == pytest.approx(72.0)
    assert t["tp"] * t["pp"] * t["dp"] == t["gpus"] and (t["gpus"] // t["pp"]) % (t["ep"] * t["etp"]) == 0
    assert 384 % t["ep"] == 0 and 64 % t["tp"] == 0
    assert r["engines"] * r["engine_gpus"] == r["gpus"] and r["concurrency_per_engine"] >= 1
    one_seq = 70272 * (1024 + 8192) / 1e9           # MLA: not split by TP
    assert r["memory_GB"]["kv_cache"] >= one_seq
    assert p["binding"]["step"] in ("staleness", "consumption (training)", "production (rollout)")
    # 70 of 72 GB in training; MLA KV of 0.65 GB per 9k-token sequence caps each attention rank below 256
    assert p["binding"]["memory"] == ("training memory (headroom < 10%), rollout memory (KV cache caps "
                                      "concurrency)")
    assert t["memory_headroom"] < 0.1 and r["concurrency_per_engine"] < 256 * r["attention_dp"]
    assert p["max_staleness"] <= 1
    assert p["steps_per_min"]["async"] >= p["steps_per_min"]["sync"] > 0
    assert p["adapter"]["refit_s"] == pytest.approx(calc * 2 / 25e9)


def test_staleness_bound_trades_with_speed():
    m, hw = load_model("kimi-k2"), Hardware()
    plans = [plan(m, hw, RLSettings(staleness=s), 64) for s in (1, 2, 8)]
    speeds = [p.steps_per_min["async"] for p in plans]
    assert speeds[0] <= speeds[1] <= speeds[2]
    assert all(p.max_staleness <= s for p, s in zip(plans, (1, 2, 8)))
    assert plans[0].binding["async_step"] == "staleness"           # generation of 8k tokens outlasts a step
    assert plans[2].binding["async_step"] != "staleness"


def test_does_not_fit_names_the_constraint_and_the_shortfall():
    m = load_model("kimi-k2")
    with pytest.raises(ValueError) as e:
        plan(m, Hardware(), RLSettings(), 16)
    msg = str(e.value)
    assert "does not fit on 16 x 80 GB" in msg and "training memory is short by" in msg and "\n" not in msg
    short = float(msg.split("short by ")[1].split(" GB")[0])
    # the shortfall is exact at the closest split: that much more usable memory (rounding aside) fits, less does not
    more = lambda gb: Hardware(memory_GB=80 + gb / 0.9)
    with pytest.raises(ValueError):
        plan(m, more(short - 0.5), RLSettings(), 16)
    assert plan(m, more(short + 0.1), RLSettings(), 16).gpus == 16


def test_bf16_training_base_does_not_fit_kimi_on_64():
    with pytest.raises(ValueError, match="does not fit on 64 x 80 GB"):
        plan(load_model("kimi-k2"), Hardware(), RLSettings(), 64, train_weight_bytes=2, rollout_weight_bytes=2)


def test_bad_staleness_and_gpu_counts():
    with pytest.raises(ValueError, match="staleness bound 0 with mode 'async'"):
        RLSettings(mode="async", staleness=0)
    assert RLSettings(mode="sync", staleness=0).staleness == 0
    m = load_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="GPU count 67: no layout divides it.*3 GPUs off.*use 64 or 72"):
        plan(m, Hardware(), RLSettings(), 67)
    with pytest.raises(ValueError, match="GPU count 1: no layout divides it"):
        plan(m, Hardware(), RLSettings(), 1)
    # one attention head (TP 1), 2 layers (PP <= 2), 4-GPU nodes: 8 GPUs leave 4 for training, DP 4 or 2, and a
    # batch of 5 divides neither; the same model with a batch of 4 plans
    one_head = spec_from_config("toy1", {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 1,
                                         "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 3, "vocab_size": 16}, "test")
    rl = dict(prompt_len=2, response_len=2, rank=2)
    with pytest.raises(ValueError, match="GPU count 8: no layout divides it for toy1 with batch 5"):
        plan(one_head, Hardware(gpus_per_node=4), RLSettings(batch=5, **rl), 8)
    assert plan(one_head, Hardware(gpus_per_node=4), RLSettings(batch=4, **rl), 8).training["gpus"] == 4


def test_hardware_json(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"predicted_steps_per_min": 1.0, "hardware": {"memory_GB": 40.0, "train_mfu": 0.5}}))
    hw = load_hardware(str(f), link_GBps=50.0)
    assert (hw.memory_GB, hw.train_mfu, hw.link_GBps, hw.bf16_TFLOPs) == (40.0, 0.5, 50.0, 989.0)
    assert hw.source == str(f)
    f.write_text("log line\n" + json.dumps({"hardware": {**Hardware().to_dict(), "source": "bench plan"}}))
    assert load_hardware(str(f)).source == "bench plan"                 # a bench's full hardware object
    with pytest.raises(ValueError, match="cannot read one JSON object"):
        load_hardware(str(tmp_path / "missing.json"))
    f.write_text(json.dumps({"hardware": {"memroy_GB": 40.0}}))
    with pytest.raises(ValueError, match="unknown keys \\['memroy_GB'\\]"):
        load_hardware(str(f))
    with pytest.raises(ValueError, match="train_mfu=1.5"):
        Hardware(train_mfu=1.5)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "moe_lora_rl.plan", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_json_and_table():
    p = _cli("--model", "kimi-k2", "--gpus", "64", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["adapter"]["params"] == 61052395520
    t = _cli("--model", "qwen3-30b-a3b", "--gpus", "16", "--mode", "sync", "--staleness", "0")
    assert t.returncode == 0 and "binding" in t.stdout and "training" in t.stdout


@pytest.mark.parametrize("args, text", [
    (("--gpus", "16"), "does not fit on 16 x 80 GB"),
    (("--staleness", "0"), "staleness bound 0"),
    (("--gpus", "67"), "GPU count 67: no layout divides it"),
    (("--model", "no-such-model"), "model 'no-such-model'"),
    (("--rank", "0"), "rank=0"),
])
def test_cli_bad_input_one_line_no_traceback(args, text):
    p = _cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert text in p.stderr and "Traceback" not in p.stderr and p.stderr.count("\n") == 1


def test_console_script_entry(monkeypatch, capsys):
    from moe_lora_rl.plan.cli import console

    monkeypatch.setattr(sys, "argv", ["moe-lora-rl", "plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--json"])
    assert console() == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == 16
    monkeypatch.setattr(sys, "argv", ["moe-lora-rl", "train"])
    assert console() == 2
