"""An adapter version number after a clear, on a live engine with prefix caching (fp32, in-process; the engine
loop's path: no prefix-cache reset per commit, requests salted by their version as rollout/loop.py salts them).

    Y as version 1, generate P (nothing cached: the reference) -> clear -> X as 3, generate P (P's blocks cached
    under X, salt v3) -> clear -> Y as 3 and as 2: refused (numbers already passed) -> Y as 5, generate P: equals the
    reference (k3 over the sampled tokens) -> control, the table made to forget the numbers it passed (the old
    behaviour): Y as 3 is admitted and P's blocks computed under X are served for Y's weights: the logprobs differ.
"""
from __future__ import annotations


def _generate(llm, prompt: list[int], version: int, n: int = 8):
    from vllm import SamplingParams

    from moe_lora_rl.vllm.versions import cache_salt

    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": cache_salt(version)}],
                       SamplingParams(max_tokens=n, min_tokens=n, temperature=0, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]
    return list(out.token_ids), lps


def _k3(ref, got) -> float:
    """k3 over the sampled tokens (mismatch.k3_kl); inf when the tokens themselves differ."""
    import torch

    from moe_lora_rl.mismatch import k3_kl

    if ref[0] != got[0]:
        return float("inf")
    return k3_kl(torch.tensor(got[1], dtype=torch.float64), torch.tensor(ref[1], dtype=torch.float64))


def version_reuse_check(llm, model: str, rank: int = 4) -> dict:
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.checks.route_reference import random_expert_adapter

    class LoopPath(InprocTransport):           # the engine loop never resets the prefix cache per commit
        def reset_prefix_cache(self) -> None:
            pass

    arch = load_arch(model)
    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    prompt = [(7 * i + 3) % (arch.vocab_size - 3) + 3 for i in range(block + 5)]   # one full block, cached
    x, y = (random_expert_adapter(arch, rank, seed=s, std=0.2) for s in (31, 32))
    tr, alpha = LoopPath(llm), 2.0 * rank
    llm.collective_rpc("moe_lora_clear")
    tr.push(1, y, rank, alpha)
    ref = _generate(llm, prompt, 1)
    llm.collective_rpc("moe_lora_clear")
    tr.push(3, x, rank, alpha)
    under_x = _generate(llm, prompt, 3)
    llm.collective_rpc("moe_lora_clear")
    refused = {}
    for v in (3, 2):
        try:
            tr.push(v, y, rank, alpha)
            refused[v] = None
        except ValueError as e:
            refused[v] = str(e)
    tr.push(5, y, rank, alpha)
    fresh = _generate(llm, prompt, 5)
    rt = llm.collective_rpc("_moe_lora_runtime")[0]
    llm.collective_rpc("moe_lora_clear")
    rt.table.passed = None                     # control: a table that forgets the numbers it passed
    tr.push(3, y, rank, alpha)
    stale = _generate(llm, prompt, 3)
    llm.collective_rpc("moe_lora_clear")
    return {"block_size": block, "prompt_len": len(prompt), "refused": {str(k): v for k, v in refused.items()},
            "k3_fresh_vs_ref": _k3(ref, fresh), "k3_stale_vs_ref": _k3(ref, stale), "k3_x_vs_ref": _k3(ref, under_x),
            "tokens_fresh_equal": fresh[0] == ref[0], "tokens_stale_equal": stale[0] == ref[0]}
