"""Run in its own process (bench serve): serving an expert adapter in vLLM's CPU engine, base vs merged vs
unmerged side by side. Prints one line "RESULT <json>".

Every model the engine serves is measured; a part that cannot be measured on this model or in this vLLM build is
left None and named under "skipped" ({field or group of fields: reason}): the exact KLs past MAX_EXACT_VOCAB, the
kernel's expert parts where vLLM has no CPU kernel (bench/workers/serve_numerics.py)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ...rollout.vllm_engine import make_engine, set_engine_env
from ...rollout.generate import capturing, start_capture


def _tps(llm, prompts, gen_len: int, repeats: int) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)        # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return repeats * len(prompts) * gen_len / (time.perf_counter() - t0)


def _kl_to_reference(llm, model, arch, peft, scale, prompts, gen_len: int) -> tuple[float, float]:
    """Monte-Carlo KL(engine || reference) per generated token and its standard error: mean of log p_engine -
    log p_ref over tokens sampled by the engine; reference = HF transformers fp32 with the adapter merged."""
    import torch

    from ...checks.route_reference import merged_hf_model
    from .serve_numerics import mc_kl

    return mc_kl(llm, merged_hf_model(model, peft, scale, torch.float32), prompts, gen_len, seed=1)


# exact decomposition fields (bench/workers/serve_numerics.py) -> bench field
EXACT = {"merged": "kl_exact_bf16_merged", "unmerged": "kl_exact_bf16_unmerged",
         "unmerged_fp32": "kl_exact_bf16_unmerged_fp32", "base_kernel": "kl_exact_base_kernel",
         "base_torch": "kl_exact_base_torch", "base_torch_fp32": "kl_exact_base_torch_fp32",
         "merged_kernel": "kl_exact_merged_kernel", "merged_rounding": "kl_exact_merged_rounding",
         **{f"expert_{k}": f"kl_exact_expert_{k}" for k in ("kernel_base", "torch_base", "torch_base_fp32", "merged",
                                                              "unmerged", "unmerged_fp32")}}
MAX_EXACT_VOCAB = 8192        # full prompt distributions per position: the tiny and medium models' vocabularies


def exact_kl_skipped(vocab_size: int) -> dict:
    """{"kl_exact": why} when this model's vocabulary leaves out every kl_exact_* field, else {}."""
    if vocab_size <= MAX_EXACT_VOCAB:
        return {}
    return {"kl_exact": f"vocabulary {vocab_size} > {MAX_EXACT_VOCAB}: the exact KLs need the full distribution at "
                        "every position (max_logprobs = vocabulary)"}


def _rounding_loss(model: str, arch, peft, rank: int, scale: float) -> float:
    """||(bf16(W + delta) - W) - delta|| / ||delta|| over every adapted expert weight: how much of the update the
    bf16 grid of the merged weights drops (W_base as the merged mode holds it, the checkpoint's values; the merge in
    fp32)."""
    import torch

    from ...models.checkpoint import HFCheckpoint
    from ...vllm.adapter_set import build_adapter_set
    from ...vllm.merge import merge_fp32
    from ...vllm.moe_torch import load_base_experts, stack_expert_lora

    ck = HFCheckpoint(model)
    ad = build_adapter_set(peft, arch, rank=rank, alpha=scale * rank, version=1)
    lost = total = 0.0
    for layer, mods in ad.layers.items():
        base = load_base_experts(ck, arch, layer, None)
        lora = stack_expert_lora(mods, arch, rank, ad.scale, torch.float32)
        w13, w2 = merge_fp32(base, lora, torch.bfloat16, layer)
        exact13, exact2 = merge_fp32(base, lora, torch.float32, layer)
        for got, want, b in ((w13, exact13, base.w13), (w2, exact2, base.w2)):
            lost += (got.float() - want).pow(2).sum().item()
            total += (want - b.float()).pow(2).sum().item()
    return (lost / total) ** 0.5


def prefix_cache_fields(prefix_on: bool, vllm_hits, route_fills, config: dict) -> tuple[dict, dict]:
    """(prefix_cache_hits / prefix_route_fills, skipped entries). With prefix caching off in the engine (vLLM's CPU
    engine turns it off for MLA attention whatever is asked) both are None and named in skipped with the reason,
    never reported as zero hits."""
    if prefix_on:
        return {"prefix_cache_hits": None if vllm_hits is None else int(vllm_hits),
                "prefix_route_fills": route_fills}, {}
    from ...vllm.mla_config import is_mla

    why = ("vLLM's CPU engine forces prefix caching (and chunked prefill) off for MLA attention"
           if is_mla(config) else "the engine runs with prefix caching off")
    return {"prefix_cache_hits": None, "prefix_route_fills": None}, {"prefix_cache_hits, prefix_route_fills": why}


def _expert_memcpy_s(model: str, arch) -> float:
    import torch

    from ...models.checkpoint import HFCheckpoint
    from ...vllm.moe_torch import load_base_experts

    ck = HFCheckpoint(model)
    ws = [t for l, m in enumerate(arch.moe_layers) if m
          for t in (lambda b: (b.w13, b.w2))(load_base_experts(ck, arch, l, torch.bfloat16))]
    t0 = time.perf_counter()
    for w in ws:
        w.clone()
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    set_engine_env()
    import torch

    from ...models.arch import load_arch
    from ...transfer.transports import InprocTransport
    from ...checks.route_reference import random_expert_adapter
    from .serve_engine import ENGINE, fp32_check, generate_groups

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--push-every-s", type=float, default=1.0)
    a = ap.parse_args(argv)
    arch = load_arch(a.model)
    alpha = 2.0 * a.rank
    peft = random_expert_adapter(arch, a.rank, seed=0, std=0.2)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, arch.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    res: dict = {"model": a.model, "rank": a.rank, "batch": a.batch, "prompt_len": a.prompt_len,
                 "gen_len": a.gen_len}
    # fp32 engine: logprobs in each mode vs HF transformers with the adapter merged (fp32)
    llm = make_engine(a.model, dtype="float32", prefix_caching=False, **ENGINE)
    for version, mode in enumerate(("merged", "unmerged"), 1):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        res[f"logprob_diff_fp32_{mode}"] = fp32_check(llm, a.model, arch, peft, a.rank, alpha, version,
                                                      n=2, length=32)["logprob_max_diff"]
    del llm
    import gc
    gc.collect()
    # bf16 engine, prefix caching and capture on: throughput, commit, KL, complete routes for groups of 4
    skipped = exact_kl_skipped(arch.vocab_size)
    exact = not skipped
    llm = make_engine(a.model, prefix_caching=True, disable_log_stats=False,
                      **({"max_logprobs": arch.vocab_size} if exact else {}), **ENGINE)
    prefix_on = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    res["tps_base"] = _tps(llm, prompts, a.gen_len, a.repeats)
    capture_ok, hits = {}, 0
    for version, mode in enumerate(("merged", "unmerged"), 1):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        tr = InprocTransport(llm)
        res[f"first_commit_s_{mode}"] = tr.push(10 * version, peft, a.rank, alpha).served["commit_s"]
        res[f"commit_s_{mode}"] = tr.push(10 * version + 1, peft, a.rank, alpha).served["commit_s"]
        res[f"tps_{mode}"] = _tps(llm, prompts, a.gen_len, a.repeats)
        res[f"kl_bf16_{mode}"], res[f"kl_bf16_se_{mode}"] = _kl_to_reference(llm, a.model, arch, peft, alpha / a.rank,
                                                                             prompts[:4], a.gen_len)
        group_prompts = torch.randint(0, arch.vocab_size, (2, 72), generator=g).tolist()
        with capturing(llm) as meta:
            try:
                generate_groups(llm, group_prompts, 4, 8, version, meta)
                capture_ok[mode] = True
            except RuntimeError as e:
                capture_ok[mode] = False
                res[f"capture_error_{mode}"] = str(e)
            hits += start_capture(llm)["prefix_route_hits"]
    vllm_hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    # the bf16 KL of each mode decomposed, exact (full distributions) on the same sequences; leaves it unmerged
    if exact:
        from .serve_numerics import kl_decomposition

        parts = kl_decomposition(llm, a.model, arch, peft, a.rank, alpha, prompts[:8], a.gen_len, seed=1,
                                 first_version=50)
        res.update({field: parts[key] for key, field in EXACT.items()})
        skipped.update({EXACT[key]: why for key, why in parts.get("skipped", {}).items()})
    else:
        res.update(dict.fromkeys(EXACT.values()))
    # the engine loop (unmerged, the mode pin needs): its overhead on the same requests, and pushes while it runs
    from ...rollout.loop import EngineLoop
    from .serve_inflight import inflight_pushes, loop_vs_batch_call

    loop = EngineLoop(llm).start()
    try:
        res.update(loop_vs_batch_call(llm, loop, prompts, a.gen_len, a.repeats))
        res.update(inflight_pushes(loop, peft, a.rank, alpha, prompts, 4 * a.gen_len, a.window_s,
                                   a.push_every_s, first_version=100))
    finally:
        loop.stop()
    del llm
    gc.collect()
    for mode in ("merged", "unmerged"):
        res[f"overhead_{mode}"] = 1 - res[f"tps_{mode}"] / res["tps_base"]
    config = json.loads((Path(a.model) / "config.json").read_text())
    prefix, why = prefix_cache_fields(prefix_on, vllm_hits, hits, config)
    skipped.update(why)
    res.update({"capture_ok": capture_ok, **prefix,
                "expert_bytes_memcpy_s": _expert_memcpy_s(a.model, arch),
                "delta_lost_to_rounding": _rounding_loss(a.model, arch, peft, a.rank, alpha / a.rank),
                "skipped": skipped})
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
