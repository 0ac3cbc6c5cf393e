"""A verl user's own Megatron + LoRA script through the drop-in override at a sharded layout, in CI: verl's
run_qwen3moe-30b_megatron_lora.sh kept key for key and scaled to CPU (recipes/verl_moe_lora/
run_qwen3moe_megatron_lora_cpu.sh: the tiny qwen3_moe, trainer TP2 EP2 ETP1 on two Ray workers, rollout TP1 so two
colocated vLLM engines, full activation recompute, KL loss, dynamic batch sizes, R3 on), 2 GRPO steps of verl's V0
main_ppo through the recipe's entry.

What it shows: every trainer rank streams the whole adapter version to the engine beside it (before, rank 1's engine
raised "weight stream ended without its header" at the first sync); vLLM's sampling log-probs on both engines equal
the TP2 EP2 trainer's recompute (training/rollout_probs_diff_max is verl's max over the whole batch, both engines'
samples); R3: the trainer replaying the captured routes is within k3 1e-6 of the rollout on every dp rank, and the
control (routes shifted one token) is far (> 1e-2)."""
import json
import os
import subprocess
import sys

import pytest

from test_verl_main_ppo_cpu import _num, _steps

pytestmark = pytest.mark.verl
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_users_script_at_tp2ep2_on_two_workers(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "2", "TP": "2", "EP": "2", "ETP": "1", "PP": "1"}
    p = subprocess.run(["bash", os.path.join(ROOT, "recipes/verl_moe_lora/run_qwen3moe_megatron_lora_cpu.sh"),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=2400)
    log = (tmp_path / "run.log").read_text()
    assert p.returncode == 0, p.stdout[-3000:]
    assert "weight stream ended without its header" not in log
    steps = _steps(log)
    assert sorted(steps) == [1, 2], p.stdout[-3000:]
    for s in steps.values():
        assert _num(s["training/rollout_probs_diff_max"]) < 1e-3          # both engines serve the trainer's weights
        assert _num(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3
        assert abs(_num(s["actor/lr"]) - 3e-6) < 1e-12                    # the script's lr, constant schedule
    checks = [json.loads(l) for l in (tmp_path / "r3_check.jsonl").read_text().splitlines()]
    assert checks and {c["version"] for c in checks} == {0, 1}
    for c in checks:
        assert c["tokens"] > 0 and c["k3_replay"] <= 1e-6 and c["k3_shifted"] > 1e-2, c
