"""Run in its own process: an in-process vLLM engine (fp32) with the moe_lora_rl worker extension. Pushes the
Megatron-trained adapters of each blob through InprocTransport and compares vLLM's prompt logprobs with
Megatron+LoRA's (from the blob's eval logits); then checks that bad pushes are refused and leave the served version.
Prints one line "RESULT <json>"."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from .vllm_env import set_engine_env

if TYPE_CHECKING:
    import torch

EXT = "moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension"


def make_llm(model: str, dtype: str = "float32", ext: str = EXT, load_format: str = "auto"):
    from vllm import LLM

    return LLM(model=model, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0,
               enable_prefix_caching=False, worker_extension_cls=ext, load_format=load_format)


def prompt_logprobs(llm, seqs) -> torch.Tensor:
    import torch
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    rows = []
    for s, o in zip(seqs, outs):
        rows.append([o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))])
    return torch.tensor(rows, dtype=torch.float64)


def megatron_logprobs(eval_tokens, eval_logits):
    import torch

    lp = torch.log_softmax(eval_logits.double(), -1)
    return lp[:, :-1].gather(-1, eval_tokens[:, 1:, None])[..., 0]


def main(argv=None) -> dict:
    set_engine_env()
    import torch

    from ..refit.rename import to_peft_tensors
    from ..models.arch import arch_from_hf_config
    from ..refit.transports import InprocTransport

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
    llm = make_llm(a.model)
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
        from ..refit.wire import checksum

        digest = checksum(tensors)
        tr._call("moe_lora_begin", version + 1, digest, a.rank, a.alpha, 1)
        tr._call("moe_lora_bucket", version + 1, 0, {**tensors, drop: tensors[drop] + 1})
        tr._call("moe_lora_commit", version + 1)
        errors["checksum"] = "accepted"
    except ValueError as e:
        errors["checksum"] = str(e)[:200]
    res["bad_push_errors"] = errors
    res["served_after_bad"] = tr.status()
    res["unchanged_after_bad"] = (prompt_logprobs(llm, seqs) - served_lp).abs().max().item()
    recovered = tr.push(version + 1, tensors, a.rank, a.alpha)   # the next good push recovers
    res["recovered_version"] = recovered.served["version"]
    from ..refit.transports import MergedInprocTransport

    merged = MergedInprocTransport(llm, a.model).push(1, tensors, a.rank, a.alpha)   # full-weight refit, same API
    res["merged_logprob_max_diff"] = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    res["merged_bytes"] = merged.bytes
    print("RESULT " + json.dumps(res))
    return res


def bench(argv=None) -> dict:
    """Side by side on one engine: LoRA-only push vs full merged-weight reload."""
    set_engine_env()
    import torch

    from ..refit.rename import to_peft_tensors
    from ..models.arch import arch_from_hf_config
    from ..refit.transports import InprocTransport, MergedInprocTransport
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--blob", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    arch = arch_from_hf_config(transformers.AutoConfig.from_pretrained(a.model))
    data = torch.load(a.data)[a.model]
    blob = torch.load(a.blob)
    seqs = data["eval"].tolist()
    want = megatron_logprobs(data["eval"], blob["eval_logits"])
    peft = to_peft_tensors(blob["adapters"], arch)
    llm = make_llm(a.model)
    tr = InprocTransport(llm)
    lora_s = []
    for i in range(a.repeats):
        lora_s.append(tr.push(i + 1, peft, a.rank, a.alpha).seconds)
    lora_diff = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    full = MergedInprocTransport(llm, a.model)     # the trainer-side merge is part of the full refit's cost
    full_s, full_bytes = [], 0
    for i in range(a.repeats):
        r = full.push(i + 1, peft, a.rank, a.alpha)
        full_s.append(r.seconds)
        full_bytes = r.bytes
    merged_diff = (prompt_logprobs(llm, seqs) - want).abs().max().item()
    lora_bytes = sum(t.numel() * t.element_size() for t in peft.values())
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {"model": a.model, "lora_bytes": lora_bytes, "full_bytes": full_bytes, "bytes_ratio": full_bytes / lora_bytes,
           "lora_refit_s": med(lora_s), "full_refit_s": med(full_s), "time_ratio": med(full_s) / med(lora_s),
           "logprob_max_diff_lora": lora_diff, "logprob_max_diff_merged": merged_diff}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["bench"]:
        bench(sys.argv[2:])
    else:
        main()
