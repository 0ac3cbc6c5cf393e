"""Megatron+LoRA (trained at given layouts, checks/lora_layouts.py) -> PEFT -> InprocTransport -> an in-process
vLLM CPU engine (fp32) with our worker extension: vLLM's prompt logprobs against Megatron+LoRA's (from each blob's
eval logits), then bad pushes refused leaving the served version, and the full merged-weight refit on the same
engine. Used by tests/e2e/test_refit_vllm.py.

    run_vllm_worker(model, blobs, data, cfg, cwd)   one engine process per model, after lora_layouts.run
    python -m kit.refit_vllm --model DIR --blobs layout=path.pt,... : prints "RESULT <json>"
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_lora_rl.lora import LoRAConfig
from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
from moe_lora_rl.checks.torchrun import run_process
from moe_lora_rl.checks.vllm_logprobs import megatron_logprobs, prompt_logprobs


def run_vllm_worker(model: str, blobs: dict[str, Path], data: Path, cfg: LoRAConfig, cwd: Path) -> dict:
    return run_process("kit.refit_vllm",
                       ["--model", model, "--blobs", ",".join(f"{k}={v}" for k, v in blobs.items()), "--data",
                        str(data), "--rank", str(cfg.rank), "--alpha", str(cfg.alpha)], cwd=cwd,
                       what="vLLM refit worker")


def main(argv=None) -> dict:
    set_engine_env()
    import torch

    from moe_lora_rl.refit.rename import to_peft_tensors
    from moe_lora_rl.models.arch import arch_from_hf_config
    from moe_lora_rl.transfer.transports import InprocTransport

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--blobs", required=True, help="comma-separated layout=path.pt (adapters, eval logits)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--alpha", type=float, required=True)
    a = ap.parse_args(argv)
    import transformers

    arch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(a.model))
    data = torch.load(a.data)[a.model]
    seqs = data["eval"].tolist()
    llm = make_engine(a.model, dtype="float32", prefix_caching=False)
    tr = InprocTransport(llm)
    base_lp = prompt_logprobs(llm, seqs)
    res: dict = {"layouts": {}}
    version = 0
    for item in a.blobs.split(","):
        layout, path = item.split("=", 1)
        blob = torch.load(path)
        tensors = to_peft_tensors(blob["adapters"], arch)
        version += 1
        push = tr.push(version, tensors, a.rank, a.alpha)
        got = prompt_logprobs(llm, seqs)
        want = megatron_logprobs(data["eval"], blob["eval_logits"])
        res["layouts"][layout] = {"logprob_max_diff": (got - want).abs().max().item(),
                                  "base_vs_lora": (base_lp - want).abs().max().item(),
                                  "push_s": push.seconds, "bytes": push.bytes, "served": push.served}
    served_lp = prompt_logprobs(llm, seqs)
    # bad pushes: each must raise ValueError and leave the served version (and outputs) untouched
    errors = {}
    drop = next(k for k in tensors if ".mlp.experts.3.down_proj.lora_B" in k)
    bad = {
        "missing_expert": (version + 1, {k: v for k, v in tensors.items()
                                         if k not in (drop, drop.replace("lora_B", "lora_A"))}),
        "half_pair": (version + 1, {k: v for k, v in tensors.items() if k != drop}),
        "stale_version": (version, tensors),
        "wrong_shape": (version + 1, {**tensors, drop: torch.zeros(tensors[drop].shape[0] + 1, a.rank)}),
        "unknown_name": (version + 1, {**tensors, "base_model.model.model.layers.0.mlp.foo.lora_A.weight":
                                       torch.zeros(a.rank, 4)}),
    }
    for what, (v, t) in bad.items():
        try:
            tr.push(v, t, a.rank, a.alpha)
            errors[what] = "accepted"
        except ValueError as e:
            errors[what] = str(e)[:200]
    try:                                               # checksum mismatch: the payload changed after hashing
        from moe_lora_rl.transfer.wire import checksum

        digest = checksum(tensors)
        tr.call("moe_lora_begin", version + 1, digest, a.rank, a.alpha, 1)
        tr.call("moe_lora_bucket", version + 1, 0, {**tensors, drop: tensors[drop] + 1})
        tr.call("moe_lora_commit", version + 1)
        errors["checksum"] = "accepted"
    except ValueError as e:
        errors["checksum"] = str(e)[:200]
    res["bad_push_errors"] = errors
    res["served_after_bad"] = tr.status()
    res["unchanged_after_bad"] = (prompt_logprobs(llm, seqs) - served_lp).abs().max().item()
    recovered = tr.push(version + 1, tensors, a.rank, a.alpha)   # the next good push recovers
    res["recovered_version"] = recovered.served["version"]
    from moe_lora_rl.refit.merged import MergedInprocTransport

    merged = MergedInprocTransport(llm, a.model).push(1, tensors, a.rank, a.alpha)   # full-weight refit, same API
    res["merged_logprob_max_diff"] = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    res["merged_bytes"] = merged.bytes
    print("RESULT " + json.dumps(res))
    return res



if __name__ == "__main__":
    main()
