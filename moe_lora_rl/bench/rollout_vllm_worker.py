"""Run in its own process: bf16 rollouts from an in-process vLLM CPU engine with routing capture on. Writes the
same rollout file as replay_check.make_rollout: tokens [N, P+G], routes (RoutesBatch field), per-token logprobs
of tokens 1.. from the engine (prompt logprobs + sampled logprobs), and the measured capture overhead."""
from __future__ import annotations

import argparse
import time

from .vllm_env import set_engine_env



def main(argv=None):
    set_engine_env()
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from ..router_replay.align import spread_pad
    from ..router_replay.routes import RoutesBatch

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--overhead-batches", type=int, default=0, help="also time generation without/with capture")
    a = ap.parse_args(argv)
    data = {}
    for model in a.models.split(","):
        llm = LLM(model=model, dtype=a.dtype, max_model_len=512, enforce_eager=True, seed=0,
                  enable_prefix_caching=False, worker_extension_cls="moe_lora_rl.vllm.worker_ext.MoELoRAWorkerExtension")
        vocab = llm.llm_engine.model_config.get_vocab_size()
        g = torch.Generator().manual_seed(11)
        prompts = torch.randint(0, vocab, (a.n, a.prompt_len), generator=g).tolist()
        sp = SamplingParams(max_tokens=a.gen_len, min_tokens=a.gen_len, temperature=1.0, seed=5, logprobs=0,
                            prompt_logprobs=0, ignore_eos=True)
        overhead = None
        if a.overhead_batches:
            def tps():
                t0 = time.perf_counter()
                for _ in range(a.overhead_batches):
                    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
                return a.overhead_batches * a.n * a.gen_len / (time.perf_counter() - t0)
            tps()                                                    # warm-up
            off, on = [], []
            for _ in range(2):                                       # interleaved: off, on, off, on
                off.append(tps())
                llm.collective_rpc("moe_lora_capture_start")
                on.append(tps())
                llm.collective_rpc("moe_lora_capture_stop")         # drops the captured routes too
            overhead = {"tps_without": sum(off) / 2, "tps_with": sum(on) / 2,
                        "capture_overhead": 1 - sum(on) / sum(off)}
        meta = llm.collective_rpc("moe_lora_capture_start")[0]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        ids = [o.request_id for o in outs]
        caps = llm.collective_rpc("moe_lora_capture_pop", args=(ids,))[0]
        llm.collective_rpc("moe_lora_capture_stop")
        tokens, samples, lps = [], [], []
        for p, o in zip(prompts, outs):
            gen = list(o.outputs[0].token_ids)
            seq = p + gen
            r = caps[o.request_id]
            if r.shape[0] != len(seq) - 1:
                raise RuntimeError(f"request {o.request_id}: captured {r.shape[0]} rows for {len(seq)} tokens")
            # the last sampled token is never forwarded by the engine: its row is padding (no loss depends on it)
            last = spread_pad(1, meta["topk"], meta["num_experts"])[None].repeat(len(meta["layer_ids"]), 1)
            samples.append(np.concatenate([r, last.astype(r.dtype)[None].reshape(1, len(meta["layer_ids"]), -1)]))
            lp = [o.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(p))]
            lp += [d[tok].logprob for tok, d in zip(gen, o.outputs[0].logprobs)]
            tokens.append(seq)
            lps.append(torch.tensor(lp, dtype=torch.float64))
        routes = RoutesBatch(samples, tuple(meta["layer_ids"]), meta["num_experts"], meta["topk"])
        data[model] = {"tokens": torch.tensor(tokens), "routes": routes.to_field(), "num_experts": routes.num_experts,
                       "logprobs": lps, "bytes_per_token": routes.bytes_per_token, "capture": overhead}
        del llm
        import gc
        gc.collect()
    torch.save(data, a.out)


if __name__ == "__main__":
    main()
