"""verl's fully-async trainer end to end on CPU with our override (recipes/verl_moe_lora/run_cpu_async.sh): every
adapter version the trainer sends is the one the rollout engine serves after the sync, and the engine's log-probs of a
fixed probe equal our Megatron engine's on that version (recomputed from its checkpoint), while the neighbouring
version's differ (the control). Warm-started default model, fp32 rollouts, 2 training steps."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fully_async_trainer_serves_every_version(tmp_path):
    from moe_lora_rl.bench.runners.verl_runs import probe_tokens

    env = {**os.environ, "PYTHON": sys.executable, "STEPS": "2"}
    p = subprocess.run(["bash", os.path.join(ROOT, "recipes/verl_moe_lora/run_cpu_async.sh"), "fully_async",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:]
    c = subprocess.run([sys.executable, "-m", "moe_lora_rl.checks.verl_async", "--run", str(tmp_path), "--model",
                        str(tmp_path / "model"), "--probe", probe_tokens()], capture_output=True, text=True,
                       timeout=900)
    assert c.returncode == 0, c.stderr[-3000:]
    res = json.loads(next(l for l in c.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert res["syncs"] >= 3 and res["versions_synced"] == 1.0            # the initial version, then one per step
    assert res["versions_served"] == [0, 1, 2]                             # two training steps, each synced
    assert res["probe_max_diff"] < 1e-3 and res["probe_diff_vs_other_version"] > 0.05
