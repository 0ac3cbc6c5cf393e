"""Run in its own process: bf16 rollouts from an in-process vLLM CPU engine with routing capture on. Writes the
same rollout file as checks/replay.make_rollout: tokens [N, P+G], routes (RoutesBatch field), per-token logprobs
of tokens 1.. from the engine (prompt logprobs + sampled logprobs), and the measured capture overhead."""
from __future__ import annotations

import argparse
import time

from ..rollout.vllm_engine import make_engine, set_engine_env
from ..rollout.generate import captured_generate, capturing


def _captured_rollout(llm, prompts, sp):
    """Generate with routing capture on: (tokens [N, P+G], RoutesBatch, per-token logprobs of tokens 1..)."""
    import torch

    from ..router_replay.routes import RoutesBatch

    with capturing(llm) as meta:
        gens = captured_generate(llm, prompts, sp, meta, pad=True)
    routes = RoutesBatch([g.routes for g in gens], tuple(meta["layer_ids"]), meta["num_experts"], meta["topk"])
    lps = [torch.tensor(g.prompt_logprobs + g.logprobs, dtype=torch.float64) for g in gens]
    return torch.tensor([g.tokens for g in gens]), routes, lps


def _adapter_rollouts(llm, model, prompts, sp, a) -> dict:
    """The same prompts while the engine serves an expert adapter (checks/route_reference.random_expert_adapter of
    --adapter-rank and --adapter-seed, alpha 2*rank, gate and up sharing A as Megatron's fused fc1 LoRA does), in
    each serving mode: tokens, routes and logprobs per mode."""
    from ..models.arch import load_arch
    from ..transfer.transports import InprocTransport
    from .route_reference import random_expert_adapter

    rank = a.adapter_rank
    peft = random_expert_adapter(load_arch(model), rank, seed=a.adapter_seed, fused_fc1=True)
    out = {"rank": rank, "alpha": 2.0 * rank, "seed": a.adapter_seed, "modes": {}}
    for version, mode in enumerate(a.adapter_modes.split(","), 1):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        served = InprocTransport(llm).push(version, peft, rank, 2.0 * rank).served
        if served["mode"] != mode:
            raise RuntimeError(f"the engine serves mode {served['mode']!r}, {mode!r} was set")
        tokens, routes, lps = _captured_rollout(llm, prompts, sp)
        out["modes"][mode] = {"tokens": tokens, "routes": routes.to_field(), "logprobs": lps}
    llm.collective_rpc("moe_lora_clear")
    return out


def main(argv=None):
    set_engine_env()
    import torch
    from vllm import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--overhead-batches", type=int, default=0, help="also time generation without/with capture")
    ap.add_argument("--adapter-modes", default="", help="also roll out while serving an expert adapter in each of "
                    "these serving modes (unmerged,merged)")
    ap.add_argument("--adapter-rank", type=int, default=8)
    ap.add_argument("--adapter-seed", type=int, default=1)
    a = ap.parse_args(argv)
    data = {}
    for model in a.models.split(","):
        llm = make_engine(model, dtype=a.dtype, prefix_caching=False)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        g = torch.Generator().manual_seed(11)
        prompts = torch.randint(0, vocab, (a.n, a.prompt_len), generator=g).tolist()
        sp = SamplingParams(max_tokens=a.gen_len, min_tokens=a.gen_len, temperature=1.0, seed=5, logprobs=0,
                            prompt_logprobs=0, ignore_eos=True)
        overhead = None
        if a.overhead_batches:
            def tps(llm):
                t0 = time.perf_counter()
                for _ in range(a.overhead_batches):
                    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
                return a.overhead_batches * a.n * a.gen_len / (time.perf_counter() - t0)
            tps(llm)                                                 # warm-up
            off, on = [], []
            for _ in range(2):                                       # interleaved: off, on, off, on
                off.append(tps(llm))
                with capturing(llm):                                 # the stop drops the captured routes too
                    on.append(tps(llm))
            overhead = {"tps_without": sum(off) / 2, "tps_with": sum(on) / 2,
                        "capture_overhead": 1 - sum(on) / sum(off)}
        tokens, routes, lps = _captured_rollout(llm, prompts, sp)
        data[model] = {"tokens": tokens, "routes": routes.to_field(), "num_experts": routes.num_experts,
                       "logprobs": lps, "bytes_per_token": routes.bytes_per_token, "capture": overhead}
        if a.adapter_modes:
            data[model]["adapter"] = _adapter_rollouts(llm, model, prompts, sp, a)
        del llm
        import gc
        gc.collect()
    torch.save(data, a.out)


if __name__ == "__main__":
    main()
