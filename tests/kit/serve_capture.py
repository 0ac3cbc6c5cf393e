"""python -m kit.serve_capture --models A,B --modes unmerged,merged (tests/e2e/test_serve_vllm.py).

In its own process, per model: an fp32 engine (prompt logprobs and routes vs HF with the adapter merged, each
serving mode; a merge that overflows is refused), then a bf16 engine (prefix caching on, routing capture on). For
each serving mode: push an expert adapter, generate groups of samples per prompt (the prompt computed once, reused
from the prefix cache), pop the routes and compare them with HF transformers' routing of the same sequences under
the same adapter (merged, bf16) and under the base model. Prints one line "RESULT <json>"."""
from __future__ import annotations

import argparse
import json

from moe_lora_rl.bench.workers.serve_engine import ENGINE, fp32_check, generate_groups
from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
from moe_lora_rl.rollout.generate import capturing, start_capture

# a decision whose fp32 reference selection scores are closer than this is a tie at bf16 precision: bf16 carries
# 8 significant bits (relative rounding 2^-9 ~ 2e-3 per value), and the router input has gone through every layer
TIE = 0.02


def capture_check(llm, model: str, arch, peft, rank: int, alpha: float, version: int, *, n_prompts=3, group=4,
                  prompt_len=72, gen_len=8, seed=0) -> dict:
    import numpy as np
    import torch

    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.checks.route_reference import agreement, hf_routes, merged_hf_model

    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, arch.vocab_size, (n_prompts, prompt_len), generator=g).tolist()
    if peft is not None:
        InprocTransport(llm).push(version, peft, rank, alpha)
    with capturing(llm) as meta:
        try:
            gens = generate_groups(llm, prompts, group, gen_len, seed, meta)
        except RuntimeError as e:                 # incomplete routes: reported, the test asserts on it
            return {"complete": False, "error": str(e)}
        meta = start_capture(llm)                 # already running: its counters
    routes, seqs = [g.routes for g in gens], [g.tokens for g in gens]
    complete = all(r.shape == (len(s) - 1, len(moe), arch.topk) for r, s in zip(routes, seqs))
    ref = [s[:-1] for s in seqs]
    want = hf_routes(merged_hf_model(model, peft, alpha / rank, torch.bfloat16), moe, ref)
    want32, margin = hf_routes(merged_hf_model(model, peft, alpha / rank, torch.float32), moe, ref, arch)
    base = hf_routes(merged_hf_model(model, None, 1.0, torch.bfloat16), moe, ref) if peft is not None else want
    return {"complete": complete, "agree_ref": agreement(routes, want), "agree_base": agreement(routes, base),
            "agree_ref_fp32": agreement(routes, want32), "agree_hf_bf16_fp32": agreement(want, want32),
            "agree_ref_choices": agreement(routes, want, per_choice=True),
            "agree_ref_fp32_untied": agreement(routes, want32, margins=margin, min_margin=TIE),
            "agree_hf_bf16_fp32_untied": agreement(want, want32, margins=margin, min_margin=TIE),
            "ties": float(np.mean(np.concatenate([(m < TIE).ravel() for m in margin]))),
            "prefix_route_hits": meta.get("prefix_route_hits", 0), "requests": len(gens),
            "rows": int(sum(r.shape[0] for r in routes)), "dtype": str(routes[0].dtype)}


def overflow_check(llm, arch, peft, rank: int, alpha: float, version: int) -> dict:
    """A merge that overflows the serving dtype is refused; the previous version keeps serving."""
    from moe_lora_rl.transfer.transports import InprocTransport

    huge = {k: v * 1e36 for k, v in peft.items()}
    tr = InprocTransport(llm)
    try:
        tr.push(version, huge, rank, alpha)
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "served_after": tr.status()}


def main(argv=None) -> dict:
    set_engine_env()
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.checks.route_reference import random_expert_adapter

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--modes", default="unmerged")
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args(argv)
    res = {}
    import gc
    for model in a.models.split(","):
        arch = load_arch(model)
        llm = make_engine(model, dtype="float32", prefix_caching=False, **ENGINE)
        exact = {}
        for version, mode in enumerate(a.modes.split(","), 1):
            llm.collective_rpc("moe_lora_clear")
            llm.collective_rpc("moe_lora_set_mode", args=(mode,))
            peft = random_expert_adapter(arch, a.rank, seed=10 + version)
            exact[mode] = fp32_check(llm, model, arch, peft, a.rank, 2.0 * a.rank, version, seed=version)
            if mode == "merged":
                exact["overflow"] = overflow_check(llm, arch, peft, a.rank, 2.0 * a.rank, version + 100)
        del llm
        gc.collect()
        llm = make_engine(model, prefix_caching=True, **ENGINE)
        from pathlib import Path

        from .vllm_peft import vllm_load_check, write_peft_dir

        peft = random_expert_adapter(arch, a.rank, seed=0)
        peft_dir = write_peft_dir(peft, arch, a.rank, 2.0 * a.rank, Path(f"peft-{arch.family}"), model)
        try:
            peft_load = vllm_load_check(llm, peft_dir, peft, arch, a.rank)
        except Exception as e:  # noqa: BLE001 - reported, the test asserts on it
            peft_load = {"error": f"{type(e).__name__}: {e}"}
        per = {"base": capture_check(llm, model, arch, None, a.rank, 2.0 * a.rank, 0)}
        version = 0
        for mode in a.modes.split(","):
            version += 1
            llm.collective_rpc("moe_lora_clear")
            llm.collective_rpc("moe_lora_set_mode", args=(mode,))
            llm.reset_prefix_cache()
            peft = random_expert_adapter(arch, a.rank, seed=version)
            per[mode] = capture_check(llm, model, arch, peft, a.rank, 2.0 * a.rank, version, seed=version)
        res[model] = {"bf16": per, "fp32": exact, "vllm_peft_load": peft_load}
        del llm
        gc.collect()
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
