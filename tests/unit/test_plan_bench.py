"""The plan bench's arithmetic (no engines, no torchrun): calibrating on times the planner itself produced recovers
its prediction at another batch exactly; a wrong measurement shows up as the error it is; bad arguments are refused
up front."""
import pytest

from moe_lora_rl.bench.plan import main
from moe_lora_rl.bench.runners.plan_model import calibrate, compare, predict, settings
from moe_lora_rl.plan import Hardware
from moe_lora_rl.plan.specs import spec_from_config

MEDIUM = spec_from_config("medium", {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
                                     "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 32,
                                     "num_experts_per_tok": 4, "moe_intermediate_size": 384, "vocab_size": 512},
                          "the project's medium qwen3_moe")


def test_compare_by_hand():
    # 2 s predicted, 2.5 s measured: 30 vs 24 steps/min, error 6/24
    assert compare(2.0, 2.5, 4, 16) == {"predicted_steps_per_min": 30.0, "measured_steps_per_min": 24.0,
                                        "error": 0.25, "calibration_batch": 4, "predicted_batch": 16}


@pytest.mark.parametrize("hw, rollout_growth", [
    (Hardware(bf16_TFLOPs=0.1, hbm_GBps=10, train_mfu=0.3, decode_flops_eff=0.5), "sub-linear"),     # memory bound
    (Hardware(bf16_TFLOPs=0.1, hbm_GBps=10, train_mfu=0.3, decode_flops_eff=1e-4), "linear"),       # compute bound
])
def test_calibration_recovers_the_model(hw, rollout_growth):
    rl1, rl2 = settings(4, 16, 32, 16), settings(16, 16, 32, 16)
    s1, s2 = predict(MEDIUM, hw, rl1), predict(MEDIUM, hw, rl2)
    # the bench's matmul ceiling stands for the decode compute rate (one calibration point cannot tell a slower
    # compute-bound decode from a memory-bound one)
    cal = calibrate(MEDIUM, rl1, s1["rollout_s"], s1["train_s"], hw.bf16_TFLOPs * 1e12 * hw.decode_flops_eff)
    assert predict(MEDIUM, cal, rl1)["step_s"] == pytest.approx(s1["step_s"], rel=1e-9)
    p2 = predict(MEDIUM, cal, rl2)
    assert p2["step_s"] == pytest.approx(s2["step_s"], rel=1e-6)
    assert compare(p2["step_s"], s2["step_s"], 4, 16)["error"] == pytest.approx(0, abs=1e-6)
    # negative control: a b2 measurement 1.5x slower than the model is a 50% error
    assert compare(p2["step_s"], 1.5 * s2["step_s"], 4, 16)["error"] == pytest.approx(0.5, rel=1e-6)
    growth = s2["rollout_s"] / s1["rollout_s"]                  # batch x4: experts saturate, FLOPs do not
    assert growth < 3 if rollout_growth == "sub-linear" else growth == pytest.approx(4, rel=0.01)


@pytest.mark.parametrize("args, text", [
    (["--layouts", "tp2ep2"], "only tp1ep1pp1"),
    (["--calibration-batch", "8", "--predicted-batch", "8"], "must be at another batch size"),
    (["--model", "a", "--model", "b"], "--model given 2 times"),
    (["--model", "/no/such/dir"], "--model '/no/such/dir': not a checkpoint directory"),
    (["--model", "kimi-k2"], "not a checkpoint directory"),
    (["--rank", "0"], "--rank=0"),
])
def test_bad_arguments_refused_up_front(args, text, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and text in err and err.count("\n") == 1 and "Traceback" not in err
