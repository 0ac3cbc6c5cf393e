"""serve: an expert adapter served by vLLM's CPU engine in both serving modes, side by side in one run.

    python -m moe_lora_rl.bench serve --json [--model DIR] [--rank 16] [--batch 16] [--prompt-len 32] [--gen-len 32]

tps_*: generated tokens/s of one batch (bf16, prefix caching and routing capture available), base model vs the
adapter merged into vLLM's MoE kernel vs applied unmerged by our batched experts; commit_s_*: the engine's part of
a commit (first_commit_s_*: the first, which also reads the base expert weights from the checkpoint); kl_bf16_*:
KL(engine || HF fp32 with the adapter merged) per generated token (Monte Carlo over 4 x gen-len sampled tokens: the
train-inference mismatch of bf16 serving; kl_bf16_se_*: its standard error, often as large as the gap between the
modes); kl_exact_*: the same KL exact (full distributions, 8 prompts' continuations sampled by the base engine, the
same sequences for every configuration; vocabularies up to 8192, else null and named in skipped) and its decomposition
(bench/workers/serve_numerics.py): kl_exact_bf16_merged / _unmerged (each mode), kl_exact_base_kernel (no adapter, vLLM's MoE
kernel vs HF fp32 base: the bf16 engine's part both modes share), kl_exact_base_torch (our experts with B = 0 vs the
same), kl_exact_merged_kernel (the merged engine vs HF fp32 on the very bf16 weights it serves: kernel part),
kl_exact_merged_rounding (HF fp32 on those weights vs on W + s*B@A: rounding part), *_fp32 (unmerged with
expert_precision="fp32": vLLM's kernel numerics), kl_exact_expert_* (the expert part alone: HF fp32 with only the
routed experts in bf16, vLLM's kernel or ours, vs the same references); logprob_diff_fp32_*: max |logprob| difference
of an fp32 engine vs that reference; delta_lost_to_rounding: the part of the update the merged bf16 weights lose;
expert_bytes_memcpy_s: one copy of all expert weights (the floor of a merged commit); capture_ok: groups of 4
samples per prompt got complete routes with prefix caching on; prefix_cache_hits: vLLM's counter (tokens).
Engine loop (bench/workers/serve_inflight.py), unmerged: tps_batch_call vs tps_loop and loop_step_overhead on the same
requests; tokens_per_s_no_pushes vs tokens_per_s_during_pushes (a new version every --push-every-s while requests
decode, --window-s each), push_cost = 1 - during / no pushes (target <= 0.10), inflight_push_stall_s: how long running
requests waited for one commit between two steps.
skipped: {field or group of fields: reason} for each part this model or this vLLM build leaves unmeasured (null
fields); any expert width the engine serves is measured (the kernel reference pads it as vLLM's MoE layer does).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..checks.torchrun import run_process
from .emit import emit


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench serve", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the medium qwen3_moe)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--window-s", type=float, default=10.0,
                    help="seconds of generation measured without pushes, then as long with pushes")
    ap.add_argument("--push-every-s", type=float, default=1.0, help="a new adapter version this often")
    a = ap.parse_args(argv)
    for name in ("rank", "batch", "prompt_len", "gen_len", "window_s", "push_every_s"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.model is None:
        from ..models import get_model

        a.model = str(get_model("qwen3_moe", "medium"))
    if not (Path(a.model) / "config.json").exists():
        ap.error(f"--model {a.model}: not an HF checkpoint directory (no config.json)")
    with tempfile.TemporaryDirectory() as d:
        result = run_process("moe_lora_rl.bench.workers.serve_worker", ["--model", a.model, "--rank", str(a.rank), "--batch",
                             str(a.batch), "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len),
                             "--window-s", str(a.window_s), "--push-every-s", str(a.push_every_s)],
                             timeout=3600, cwd=d, what="serve bench worker")
    emit(result, a.json)
    return result
