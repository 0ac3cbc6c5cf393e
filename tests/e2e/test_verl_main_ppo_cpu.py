"""verl's main_ppo end to end on CPU through our recipe (recipes/verl_moe_lora/run_cpu_smoke.sh): our engine, replica,
worker extension and CPU platform, 2 GRPO steps (colocated sync, R3 on: verl's routed_experts filled from our capture,
replayed by our engine), on the tiny GLM-4.5-style model and on the plain-RoPE DeepSeek-V3 model (MLA: verl's server
started with the engine settings our own engine uses, vllm/mla_config.engine_args, and our worker extension's
plain-RoPE fix), and on the tiny Qwen3.5-MoE hybrid (the family's CPU fixes through the replica's hooks and our
CPU worker class). Asserts on the numbers verl logs per step and on the in-run R3 check. The CI check of the MLA engine
settings is tests/unit/test_verl_config.py::test_mla_engine_settings_through_replica_hooks, of the hybrid's
test_hybrid_engine_settings_through_replica_hooks."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps(log: str) -> dict[int, dict[str, str]]:
    out = {}
    for line in log.splitlines():
        m = re.search(r"step:(\d+) - (.*)$", line)
        if m:
            out[int(m.group(1))] = dict(kv.split(":", 1) for kv in m.group(2).split(" - ") if ":" in kv)
    return out


def _num(v: str) -> float:
    return float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", v))


def _run(out, *overrides, **env) -> tuple[str, dict[int, dict[str, str]]]:
    """The recipe's 2 steps in `out` with verl overrides and environment: (its log, the logged steps 1 and 2)."""
    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "2", **env}
    p = subprocess.run(["bash", os.path.join(ROOT, "recipes/verl_moe_lora/run_cpu_smoke.sh"), str(out), *overrides],
                       env=env, capture_output=True, text=True, timeout=1800)
    log = (out / "run.log").read_text()
    assert p.returncode == 0, p.stdout[-3000:]
    steps = _steps(log)
    assert sorted(steps) == [1, 2]
    return log, steps


def _smoke(tmp_path, **env) -> str:
    log, steps = _run(tmp_path, **env)
    for s in steps.values():
        assert math.isfinite(_num(s["actor/loss"])) and math.isfinite(_num(s["actor/grad_norm"]))
        assert 0.0 <= _num(s["critic/score/mean"]) <= 1.0              # our reward ran on every rollout
        assert _num(s["response_length/mean"]) > 0
        # vLLM's sampling log-probs against our Megatron engine's on the same tokens: only equal if the colocated
        # sync put the base and the adapters into vLLM (the script starts vLLM on dummy weights; with the base load
        # removed from our worker extension the run gives 0.067 and a log-ppl difference of 12.0)
        assert _num(s["training/rollout_probs_diff_max"]) < 1e-3
        assert _num(s["rollout_corr/log_ppl_abs_diff"]) < 1e-3
    assert log.count("update_weights done") >= 3          # the first sync (base + adapters), then one per step
    # R3: verl's actor replayed the capture's routes and its fp32 recompute equals the fp32 rollout (~1e-11); one
    # check line per log-prob recompute carrying the rollout's log-probs (the two training steps). The contrast with
    # the trainer's own routing needs a model whose routing flips (bench verl: the wide model, main_ppo_r3_off_kl)
    checks = [json.loads(l) for l in (tmp_path / "r3_check.jsonl").read_text().splitlines()]
    assert len(checks) == 2 and all(c["tokens"] > 0 for c in checks)
    assert max(c["k3_replay"] for c in checks) < 1e-8 and max(c["max_abs_diff_replay"] for c in checks) < 1e-3
    # negative control in the same recomputes: the rollout's routes one token off
    assert min(c["k3_shifted"] for c in checks) > 1e-5
    return log


def test_main_ppo_two_steps_on_cpu(tmp_path):
    _smoke(tmp_path)


def test_main_ppo_two_steps_on_cpu_mla(tmp_path):
    """The same on deepseek_v3 tiny_rope (plain RoPE, where vLLM's CPU rotary kernel is wrong at every position past
    0 without our fix; with the fix removed from the worker extension this run's rollout log-probs differ from the
    trainer's by up to 20.3, probabilities by 0.998, and the replayed k3 is 4.0: docs/mla.md). 442 s here under load."""
    from moe_lora_rl.models import get_model

    log = _smoke(tmp_path, MODEL=str(get_model("deepseek_v3", "tiny_rope")))
    assert "'--attention_backend'" in log and "'CPU_MLA'" in log      # verl's server started on our MLA backend


def test_main_ppo_two_steps_on_cpu_hybrid(tmp_path):
    """The same on qwen3_5_moe tiny (Gated DeltaNet + gated attention, every layer MoE): verl's server gets the fixes
    our own engine takes for the family on CPU: its engine built inside vllm/vision_import_fix.scoped and its
    spawned workers loading the model through our CPU worker class (vLLM's qwen3_5.py imports transformers'
    torchvision image processor), the delta-net torch core (vllm/gdn_torch.py: vLLM's CPU op is bf16-only, head
    widths 64/128 only) with our worker extension. 851 s here under load (rollout probs within 7.4e-6 of the trainer's,
    k3 replay 2.2e-11, shifted routes 7.6). With vLLM's own CPU worker (engine_kwargs.vllm.worker_cls) the spawned
    worker cannot import the model (no torchvision) and the engine never starts."""
    from moe_lora_rl.models import get_model

    log = _smoke(tmp_path, MODEL=str(get_model("qwen3_5_moe", "tiny")))
    assert "'--worker_cls'" in log and "'moe_lora_rl.vllm.cpu_worker.VisionFixCPUWorker'" in log


GSM8K_REWARD = '''
import os
from verl.utils.reward_score import gsm8k


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt"), "a") as f:
        f.write(f"{data_source} {extra_info['split']} {extra_info['index']}\\n")
    return {"score": gsm8k.compute_score(solution_str, ground_truth), "answered": float("####" in solution_str)}
'''


def test_main_ppo_on_a_gsm8k_file_with_a_reward_file(tmp_path):
    """The verl route on a dataset of ours (python -m moe_lora_rl.data gsm8k_add1: verl's gsm8k row format) with a
    reward file of verl's signature: the recipe fits the prompt length to the files (their longest chat prompt, over
    the sort task's 32) and the responses (64 tokens on files); every rollout is scored by the file's function with
    the row's data_source and extra_info as verl hands them (2 steps x batch 2 x n 2 = 8 calls)."""
    from moe_lora_rl.data import write

    paths = write("gsm8k_add1", tmp_path / "data")
    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "reward.py").write_text(GSM8K_REWARD)
    _, steps = _run(tmp_path / "run", f"data.train_files={paths['train']}", f"data.val_files={paths['val']}",
                    f"reward.custom_reward_function.path={tmp_path / 'reward' / 'reward.py'}",
                    "reward.custom_reward_function.name=compute_score")
    for s in steps.values():
        assert math.isfinite(_num(s["actor/loss"])) and 0.0 <= _num(s["critic/score/mean"]) <= 1.0
        assert 0 < _num(s["response_length/mean"]) <= 64
        assert _num(s["prompt_length/max"]) > 32                        # the files' prompts, longer than the sort's
    calls = (tmp_path / "reward" / "calls.txt").read_text().split("\n")[:-1]
    assert len(calls) == 8 and all(c.startswith("openai/gsm8k train ") for c in calls), calls
