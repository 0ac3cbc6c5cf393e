"""What bench verl reads from verl's console log and our in-run R3 check file (verl 0.9.1's line format)."""
import json

import pytest

from moe_lora_rl.bench.runners.verl_runs import parse_curve, parse_r3, parse_r3_by_rank, parse_steps, parse_timing, parse_val

LOG = """(MoELoRATaskRunner pid=1) step:0 - val-core/moe_lora_rl/addition/acc/mean@1:np.float64(0.30859375) - \
val-aux/moe_lora_rl/addition/reward/mean@1:np.float64(0.30859375)
(MoELoRATaskRunner pid=1) step:1 - actor/loss:np.float64(0.01) - training/global_step:1 - training/epoch:0 - \
critic/score/mean:0.25 - timing_s/gen:np.float64(6.5) - timing_s/update_actor:4.0 - timing_s/step:12.5
(MoELoRATaskRunner pid=1) step:2 - actor/loss:np.float64(0.02) - training/global_step:2 - \
critic/score/mean:np.float64(0.375) - timing_s/gen:7.5 - timing_s/step:np.float64(14.0) - timing_s/testing:20.0 - \
val-core/moe_lora_rl/addition/acc/mean@1:0.5
(MoELoRATaskRunner pid=1) Training Progress: step:3 is not a metrics line
"""


def test_validation_curve_and_steps_from_verls_log():
    assert parse_val(LOG) == {0: 0.30859375, 2: 0.5}
    assert parse_steps(LOG) == 2                           # the validation-only line of step 0 trains nothing


def test_timings_and_reward_curve_from_verls_log():
    """bench peers: verl's per-step seconds summed over the training steps, and (step, seconds, reward) per step."""
    assert parse_timing(LOG) == {"gen": 14.0, "update_actor": 4.0, "step": 26.5, "testing": 20.0}
    assert parse_curve(LOG) == [(1, 12.5, 0.25), (2, 14.0, 0.375)]


def test_r3_check_means_and_a_missing_file(tmp_path):
    f = tmp_path / "r3_check.jsonl"
    rows = [{"k3_replay": 1e-11, "k3_free": 3e-6, "max_abs_diff_replay": 1e-5, "max_abs_diff_free": 0.4},
            {"k3_replay": 3e-11, "k3_free": 1e-6, "max_abs_diff_replay": 2e-5, "max_abs_diff_free": 0.1}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = parse_r3(f)
    assert got["k3_replay"] == pytest.approx(2e-11) and got["k3_free"] == pytest.approx(2e-6)
    assert got["recomputes"] == 2 and got["max_abs_diff_free"] == 0.4
    with pytest.raises(RuntimeError, match="no R3 check lines"):
        parse_r3(tmp_path / "missing.jsonl")


def test_r3_check_per_data_parallel_rank(tmp_path):
    """bench verl_user: each dp rank's own means (a rank whose routes were wrong must not hide in the average)."""
    f = tmp_path / "r3_check.jsonl"
    rows = [{"dp_rank": 0, "k3_replay": 1e-11, "k3_free": 3e-6, "k3_shifted": 2.0},
            {"dp_rank": 1, "k3_replay": 0.5, "k3_free": 1e-6, "k3_shifted": 3.0},
            {"dp_rank": 0, "k3_replay": 3e-11, "k3_free": 1e-6, "k3_shifted": 4.0}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = parse_r3_by_rank(f)
    assert sorted(got) == [0, 1] and got[0]["recomputes"] == 2 and got[1]["k3_replay"] == 0.5
    assert got[0]["k3_replay"] == pytest.approx(2e-11) and got[0]["k3_shifted"] == pytest.approx(3.0)
    with pytest.raises(RuntimeError, match="no R3 check lines"):
        parse_r3_by_rank(tmp_path / "missing.jsonl")
