"""An engine started empty (load_format=dummy) gets the base over shared memory (transfer/shm_sender.py ->
vllm/base_sync.py, through vLLM's weight-transfer calls) and must then serve exactly what the same engine loaded
from disk serves: fp32 greedy tokens identical, prompt logprobs max |diff| 0. Then the refusals, each leaving the
served weights as they were: a bucket with one byte flipped (its digest), a version with a bucket never sent, an
older version. Control: a base with one tensor perturbed is sent and served (its logprobs differ), and a refused
update after it leaves exactly its logprobs. The base sent again inline (transport http, the bytes inside each call):
a flipped byte refused, then exactly the disk-loaded engine's tokens and logprobs. Then an expert adapter is pushed and served
with routing capture on: the sampled tokens, their logprobs and the captured routes equal the disk-loaded engine's
under the same adapter. On an MLA model the dummy engine's kv_b_proj weights are first untied from the absorbed
W_UK_T / W_UV, so equal decoded tokens show those are re-derived from the synced weights. Used by
tests/e2e/test_base_sync.py.

    python -m kit.base_sync_check --model DIR [--bucket-kb 256]   prints "RESULT <json>"
"""
from __future__ import annotations

import argparse
import base64
import json
import os
from pathlib import Path

from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
from moe_lora_rl.checks.torchrun import run_process
from moe_lora_rl.checks.vllm_logprobs import prompt_logprobs


def run_base_sync(model: str, cwd: Path, bucket_kb: int = 256) -> dict:
    return run_process("kit.base_sync_check", ["--model", model, "--bucket-kb", str(bucket_kb)], cwd=cwd,
                       what="base sync worker")


def _refused(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return " ".join(str(e).split())[:300]
    return ""


def main(argv=None) -> dict:
    set_engine_env()
    import torch
    from vllm import SamplingParams

    from moe_lora_rl.transfer.shm import ROOT
    from moe_lora_rl.transfer.shm_sender import checkpoint_tensors, send_base

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bucket-kb", type=int, default=256)
    a = ap.parse_args(argv)
    size = a.bucket_kb << 10
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (16, 16, 16, 16)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    import numpy as np

    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.rollout.generate import captured_generate, capturing
    from moe_lora_rl.checks.route_reference import random_expert_adapter

    arch = load_arch(a.model)
    peft = random_expert_adapter(arch, 4, seed=0)
    sampled = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, logprobs=0, ignore_eos=True)
               for i in range(len(prompts))]

    def adapted(llm):                    # the adapter served, routes captured: tokens, logprobs, routes
        InprocTransport(llm).push(1, peft, 4, 8.0)
        with capturing(llm) as meta:
            gens = captured_generate(llm, prompts, sampled, meta)
        return [g.tokens for g in gens], [g.logprobs for g in gens], [g.routes for g in gens]

    def serve(llm):
        toks = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                              use_tqdm=False)]
        return [list(t) for t in toks], prompt_logprobs(llm, [p + t for p, t in zip(prompts, toks)])

    disk = make_engine(a.model, dtype="float32", prefix_caching=False)
    ref_tokens, ref_lp = serve(disk)
    ref_adapted = adapted(disk)
    del disk
    llm = make_engine(a.model, dtype="float32", prefix_caching=False, load_format="dummy")
    # MLA: kv_b_proj.weight untied from the W_UK_T / W_UV derived from it (an fp32 engine shares their storage, so an
    # in-place load would reach decode by accident): the synced base decodes right only if they are re-derived
    from .mla_serve import _unalias_kv_b

    _unalias_kv_b(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model)

    def rpc(method, *args):
        return llm.collective_rpc(method, args=args)

    def status():
        return rpc("moe_lora_base_status")[0]["served"]

    dummy_tokens, dummy_lp = serve(llm)
    tensors = checkpoint_tensors(a.model)
    res: dict = {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                 "dummy_differs": (dummy_lp - ref_lp).abs().max().item()}

    def flip_bucket(k):                  # the engine reads bucket k's segment with one byte changed
        def wrapped(method, *args):
            if method == "update_weights" and args[0]["index"] == k:
                with open(ROOT / args[0]["handle"], "r+b") as f:
                    f.seek(os.path.getsize(ROOT / args[0]["handle"]) // 2)
                    b = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([b[0] ^ 1]))
            return rpc(method, *args)
        return wrapped

    def flip_inline(k):                  # bucket k's inline bytes with one byte changed on the way
        def wrapped(method, *args):
            if method == "update_weights" and args[0]["index"] == k:
                raw = bytearray(base64.b64decode(args[0]["data"]))
                raw[len(raw) // 2] ^= 1
                args = ({**args[0], "data": base64.b64encode(bytes(raw)).decode()},)
            return rpc(method, *args)
        return wrapped

    def skip_bucket(k):
        def wrapped(method, *args):
            if method == "update_weights" and args[0]["index"] == k:
                return None
            return rpc(method, *args)
        return wrapped

    res["corrupt_refused"] = _refused(lambda: send_base(flip_bucket(1), tensors, 1, size))
    res["served_after_corrupt"] = status()
    res["incomplete_refused"] = _refused(lambda: send_base(skip_bucket(2), tensors, 1, size))
    res["served_after_incomplete"] = status()
    res["timers"] = send_base(rpc, tensors, 1, size)
    res["served"] = status()
    tokens, lp = serve(llm)
    res["tokens_equal"] = tokens == ref_tokens
    res["logprob_max_diff"] = (lp - ref_lp).abs().max().item()
    res["stale_refused"] = _refused(lambda: send_base(rpc, tensors, 1, size))
    # control: one tensor perturbed is served as version 2 (the comparison sees it), then a refused version 3
    # leaves exactly version 2's weights
    name = next(n for n in tensors if "experts.0." in n and "down_proj" in n)
    perturbed = {**tensors, name: tensors[name] + 0.05}
    send_base(rpc, perturbed, 2, size)
    _, lp2 = serve(llm)
    res["perturbed_diff"] = (lp2 - ref_lp).abs().max().item()
    res["corrupt3_refused"] = _refused(lambda: send_base(flip_bucket(0), tensors, 3, size))
    _, lp3 = serve(llm)
    res["after_refused_vs_v2"] = (lp3 - lp2).abs().max().item()
    res["served_final"] = status()
    # the same base inline (transport http: each bucket's bytes inside its call, for an engine on another host): a
    # flipped byte refused by the digest, then version 4 serves exactly the disk-loaded base
    res["http_corrupt_refused"] = _refused(lambda: send_base(flip_inline(1), tensors, 4, size, transport="http"))
    res["served_after_http_corrupt"] = status()
    res["http_timers"] = send_base(rpc, tensors, 4, size, transport="http")
    tokens4, lp4 = serve(llm)
    res["http_tokens_equal"] = tokens4 == ref_tokens
    res["http_logprob_max_diff"] = (lp4 - ref_lp).abs().max().item()
    toks, lps, routes = adapted(llm)
    res["adapted_tokens_equal"] = toks == ref_adapted[0]
    res["adapted_logprob_max_diff"] = max(abs(x - y) for u, v in zip(lps, ref_adapted[1]) for x, y in zip(u, v))
    res["adapted_routes_equal"] = all(np.array_equal(r, q) for r, q in zip(routes, ref_adapted[2]))
    res["adapted_routes_rows"] = int(sum(r.shape[0] for r in routes))
    res["base_after_adapter_refused"] = _refused(lambda: send_base(rpc, tensors, 5, size))
    res["http_after_adapter_refused"] = _refused(lambda: send_base(rpc, tensors, 5, size, transport="http"))
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
