"""Both tiny models load and generate in vLLM's CPU build, matching HF transformers (fp32).

Tolerance 1e-4 on per-token logprobs: the same fp32 math in two implementations (measured ~1e-5).

On the same engine (fp32, prefix caching on, no reset per commit, requests salted by version as the engine loop
does; tests/kit/version_reuse.py): adapter Y's first serve (version 1) is the reference; after X served as version 3
and a clear, Y as version 3 or 2 is refused naming the number; Y as version 5 gives the reference's tokens with
k3 <= 1e-10. Control: the table made to forget the numbers it passed admits Y as 3, and the prompt blocks cached
under X are served for Y: k3 > 1e-6 or other tokens.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lora_rl.models import get_model
from moe_lora_rl.checks.torchrun import worker_env
from moe_lora_rl.checks.layouts import DEFAULT_FAMILIES

pytestmark = pytest.mark.vllm


def test_vllm_imports():
    """vLLM installed but broken must fail here, not skip (the compat venv deselects the marker instead)."""
    import vllm

    assert vllm.__version__


# the GQA families; MLA (deepseek_v3: prefix caching forced off on the CPU engine) has its own: test_mla_vllm.py
@pytest.mark.parametrize("family", DEFAULT_FAMILIES)
def test_vllm_cpu_matches_hf(family, tmp_path):
    path = get_model(family)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_greedy_worker.py")), str(path)],
                          env=worker_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["greedy_equal"], res
    assert res["logprob_max_diff"] < 1e-4, res
    v = res["version_reuse"]
    for n in ("3", "2"):
        assert v["refused"][n] and f"adapter version {n} was already passed" in v["refused"][n], v
    assert v["tokens_fresh_equal"] and v["k3_fresh_vs_ref"] <= 1e-10, v
    assert v["k3_stale_vs_ref"] > 1e-6, v                   # the stale path (inf: other tokens) differs
    assert v["k3_x_vs_ref"] > 1e-6, v                       # X and Y differ at all
