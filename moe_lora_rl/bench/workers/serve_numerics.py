"""python -m moe_lora_rl.bench.workers.serve_numerics --model DIR [--seeds 0,1,2]: where the bf16 serving modes' KL to the
fp32 reference comes from (bench serve's decomposition; one process, one bf16 engine).

Exact KL(engine || reference) per token from full distributions (prompt logprobs over the whole vocabulary),
teacher-forced on the same sequences for every configuration (random prompts + continuations sampled by the base
engine), so the configurations are compared pairwise and the only sampling noise is the choice of sequences:

    base_kernel      no adapter, vLLM's MoE kernel                         vs HF fp32 base
    base_torch       an adapter with B = 0 served unmerged (our experts)   vs HF fp32 base
    merged           W + s*B@A rounded to bf16 in vLLM's kernel             vs HF fp32 W + s*B@A
    merged_kernel    the same engine                                        vs HF fp32 on the served bf16 weights
    merged_rounding  HF fp32 on the served bf16 weights                     vs HF fp32 W + s*B@A (no engine)
    unmerged         our experts, LoRA factors unmerged                     vs HF fp32 W + s*B@A
    *_fp32           base_torch / unmerged with expert_precision="fp32" (the kernel's numerics)
    unmerged_rounded the same with the pre-fix arithmetic (expert_mlp_rounded_outputs, the negative control)
    base_torch_rounded  base_torch with it

The expert part alone, no engine (expert_*): HF fp32 everywhere except the routed experts, which run in bf16
arithmetic on bf16 inputs (the MoE block's input rounded, the output rounded once), vs the same references:

    expert_kernel_base           vLLM's kernel on the bf16 base weights
    expert_torch_base            our experts (moe_torch._expert_mlp, expert_precision "serving"), no adapter
    expert_merged                vLLM's kernel on the merged bf16 weights (kernel + rounding part)
    expert_unmerged              our experts with the adapter unmerged
    expert_*_fp32                ours with expert_precision "fp32"
    expert_*_rounded             ours with the pre-fix arithmetic (negative control)

vLLM's kernel is called as its CPU MoE layer calls it, on expert weights zero-padded to a width that is a multiple
of 32 (pad_expert_width), so every width the engine serves is measured. Where this vLLM build has no CPU kernel, the
two expert_* parts that need it are left out and named, with the reason, under "skipped".

Also the Monte-Carlo estimate bench serve reports (kl_mc_*: mean log p_engine - log p_ref over engine-sampled
tokens) for the same seeds, to show its spread. Prints one line "RESULT <json>"."""
from __future__ import annotations

import argparse
import json

from ...rollout.vllm_engine import make_engine, set_engine_env
from ...rollout.generate import captured_generate


# vLLM's CPU MoE layer zero-pads the experts' width to a multiple of 32 before it prepacks the weights, since its kernel
# tiles the w13 output in blocks of 32 (CPUUnquantizedExperts._pad_moe_intermediate, vLLM 0.32); unpadded, a width of
# 48 fails the kernel's check, which the engine itself never meets
KERNEL_WIDTH_ALIGN = 32
KERNEL_PARTS = ("expert_kernel_base", "expert_merged")


def pad_expert_width(w13, w2, align: int = KERNEL_WIDTH_ALIGN):
    """w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] zero-padded to the width I rounded up to `align`,
    laid out as vLLM's CPU MoE layer lays them (gate rows in [0, I), up rows in [P, P + I)): a padded unit outputs
    silu(0) * 0 = 0 and w2 gives it zero weight, so the experts' output is the unpadded one."""
    E, two_i, H = w13.shape
    width = two_i // 2
    padded = -(-width // align) * align
    if padded == width:
        return w13, w2
    p13 = w13.new_zeros(E, 2 * padded, H)
    p13[:, :width], p13[:, padded:padded + width] = w13[:, :width], w13[:, width:]
    p2 = w2.new_zeros(E, w2.shape[1], padded)
    p2[:, :, :width] = w2
    return p13, p2


def cpu_kernel_missing() -> str | None:
    """Why vLLM's CPU fused-MoE kernel cannot be called in this process (a build without CPU ops), or None."""
    try:
        import torch
        import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops into torch.ops._C)

        torch.ops._C.cpu_fused_moe
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"vLLM's CPU fused-MoE kernel is not in this vLLM build ({type(e).__name__}: {e})"
    return None


def expert_mlp_rounded_outputs(x, w, ids, base, lora):
    """The unmerged experts before they followed vLLM's kernel order (the negative control): bf16 GEMMs whose
    outputs are rounded to the serving dtype before the activation and before the gate weighting, and the LoRA delta
    through bf16 factors with two more rounded GEMM outputs, added to the rounded base projection."""
    import torch
    import torch.nn.functional as F

    dt = x.dtype
    w13, w2 = base.w13.to(dt), base.w2.to(dt)
    T, k = ids.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.bincount(flat, minlength=E)
    slot = torch.arange(T * k) - (torch.cumsum(counts, 0) - counts)[expert]
    tok = order // k
    xp = x.new_zeros(E, int(counts.max()), x.shape[1])
    xp[expert, slot] = x[tok]
    h13 = torch.bmm(xp, w13.transpose(1, 2)).float()
    if lora is not None:
        a13, b1, b3, a2, b2 = (t.to(dt) for t in (lora.a13, lora.b1, lora.b3, lora.a2, lora.b2))
        r = b1.shape[2]
        t = torch.bmm(xp, a13.transpose(1, 2))
        h13 = h13 + torch.cat([torch.bmm(t[..., :r], b1.transpose(1, 2)),
                               torch.bmm(t[..., r:], b3.transpose(1, 2))], -1).float()
    h = (F.silu(h13[..., :I]) * h13[..., I:]).to(dt)
    y = torch.bmm(h, w2.transpose(1, 2)).float()
    if lora is not None:
        y = y + torch.bmm(torch.bmm(h, a2.transpose(1, 2)), b2.transpose(1, 2)).float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    out.index_add_(0, tok, y[expert, slot] * w.reshape(-1)[order, None])
    return out


def full_logprobs(llm, seqs: list[list[int]], vocab: int):
    """Engine log-probabilities [n, len - 1, vocab] of every next token of each sequence (teacher-forced)."""
    import torch
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=vocab), use_tqdm=False)
    res = torch.full((len(seqs), len(seqs[0]) - 1, vocab), float("-inf"), dtype=torch.float64)
    for i, o in enumerate(outs):
        for j, d in enumerate(o.prompt_logprobs[1:]):
            for t, lp in d.items():
                res[i, j, t] = lp.logprob
    return res


def hf_logprobs(model, seqs: list[list[int]]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor(seqs)).logits.double(), -1)[:, :-1]


def kl(p_log, q_log, start: int) -> float:
    """Mean over positions >= start of KL(p || q) (natural log)."""
    p, q = p_log[:, start:], q_log[:, start:]
    term = p.exp() * (p - q)
    return float(term.nan_to_num(0.0).sum(-1).mean())


def served_expert_weights(model: str, arch, peft, rank: int, alpha: float, dtype):
    """{layer: (w13, w2)} exactly as the merged mode serves them (merge.merge_fp32 of the runtime's pristine copy:
    the checkpoint's values)."""
    import torch

    from ...models.checkpoint import HFCheckpoint
    from ...vllm.adapter_set import build_adapter_set
    from ...vllm.merge import merge_fp32
    from ...vllm.moe_torch import load_base_experts, stack_expert_lora

    ck = HFCheckpoint(model)
    ad = build_adapter_set(peft, arch, rank=rank, alpha=alpha, version=1)
    out = {}
    for layer, mods in ad.layers.items():
        base = load_base_experts(ck, arch, layer, None)
        lora = stack_expert_lora(mods, arch, rank, ad.scale, torch.float32)
        out[layer] = merge_fp32(base, lora, dtype, layer)
    return out


def with_expert_weights(hf, weights: dict):
    """HF model (fp32) with its routed experts' weights replaced (values as given, computed in fp32)."""
    for layer, (w13, w2) in weights.items():
        ex = hf.model.layers[layer].mlp.experts
        ex.gate_up_proj.data.copy_(w13.float())
        ex.down_proj.data.copy_(w2.float())
    return hf


def expert_part(model: str, arch, peft, rank: int, alpha: float, seqs, start: int, lp_base, lp_ref,
                negative_control: bool = True) -> dict:
    """The expert_* KLs of the module docstring (vLLM's CPU kernel called directly, as its MoE layer calls it, on
    weights padded as it pads them); without the kernel, its parts are named under "skipped" with the reason."""
    import torch

    from ...models.checkpoint import HFCheckpoint
    from ...vllm import moe_torch
    from ...vllm.adapter_set import build_adapter_set
    from ...checks.route_reference import merged_hf_model

    ck = HFCheckpoint(model)
    ad = build_adapter_set(peft, arch, rank=rank, alpha=alpha, version=1)
    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    base = {l: moe_torch.load_base_experts(ck, arch, l, torch.bfloat16) for l in moe}
    base32 = {l: moe_torch.load_base_experts(ck, arch, l, torch.float32) for l in moe}
    lora = {l: moe_torch.stack_expert_lora(ad.layers[l], arch, rank, ad.scale, torch.float32) for l in moe}
    served = served_expert_weights(model, arch, peft, rank, alpha, torch.bfloat16)
    hf = merged_hf_model(model, None, 1.0, torch.float32)

    def kernel(weights):
        from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

        bf16 = {l: pad_expert_width(w13.to(torch.bfloat16), w2.to(torch.bfloat16)) for l, (w13, w2) in weights.items()}
        packed = {l: (cpu_prepack_moe_weight(w13.contiguous(), "vec"), cpu_prepack_moe_weight(w2.contiguous(), "vec"))
                  for l, (w13, w2) in bf16.items()}

        def f(l, h, ids, w):
            out = torch.empty(h.shape, dtype=torch.bfloat16)
            cpu_fused_moe(out, h.to(torch.bfloat16), *packed[l], None, None, w.float().contiguous(),
                          ids.to(torch.int32), "silu", "vec")
            return out
        return f

    def torch_experts(fn, with_lora, copy=base):
        return lambda l, h, ids, w: fn(h.to(torch.bfloat16), w.float(), ids, copy[l],
                                       lora[l] if with_lora else None).to(torch.bfloat16)

    def run(f, want):
        for l in moe:
            hf.model.layers[l].mlp.experts.forward = lambda h, ids, w, l=l: f(l, h, ids, w).float()
        try:
            return kl(hf_logprobs(hf, seqs), want, start)
        finally:
            for l in moe:
                del hf.model.layers[l].mlp.experts.forward
    missing = cpu_kernel_missing()
    res = {"expert_kernel_base": None if missing else run(kernel({l: (b.w13, b.w2) for l, b in base.items()}), lp_base),
           "expert_torch_base": run(torch_experts(moe_torch._expert_mlp, False), lp_base),
           "expert_merged": None if missing else run(kernel(served), lp_ref),
           "expert_unmerged": run(torch_experts(moe_torch._expert_mlp, True), lp_ref),
           "expert_torch_base_fp32": run(torch_experts(moe_torch._expert_mlp, False, base32), lp_base),
           "expert_unmerged_fp32": run(torch_experts(moe_torch._expert_mlp, True, base32), lp_ref)}
    if negative_control:
        res["expert_torch_base_rounded"] = run(torch_experts(expert_mlp_rounded_outputs, False), lp_base)
        res["expert_unmerged_rounded"] = run(torch_experts(expert_mlp_rounded_outputs, True), lp_ref)
    if missing:
        res["skipped"] = dict.fromkeys(KERNEL_PARTS, missing)
    return res


def mc_kl(llm, ref, prompts, gen_len: int, seed: int) -> float:
    """bench serve's estimate, (mean, its standard error): log p_engine - log p_ref over tokens the engine
    sampled."""
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, seed=seed, logprobs=0,
                        ignore_eos=True)
    diffs = []
    for g in captured_generate(llm, prompts, sp):
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([g.tokens])).logits.double()[0], -1)
        diffs += [e - lp[len(g.prompt) - 1 + j, tok].item() for j, (tok, e) in enumerate(zip(g.response, g.logprobs))]
    d = torch.tensor(diffs, dtype=torch.float64)
    return float(d.mean()), float(d.std() / len(d) ** 0.5)


def kl_decomposition(llm, model: str, arch, peft, rank: int, alpha: float, prompts: list[list[int]], gen_len: int,
                     seed: int, first_version: int, base_ref=None, negative_control: bool = False) -> dict:
    """One adapter, one set of prompts: the exact KLs of the module docstring on the prompts' continuations sampled
    by the base engine (bf16 engine made with max_logprobs >= vocab). Leaves the engine unmerged, serving `peft`."""
    import torch
    from vllm import SamplingParams

    from ...transfer.transports import InprocTransport
    from ...vllm import moe_torch
    from ...checks.route_reference import merged_hf_model

    V = arch.vocab_size
    scale = alpha / rank
    base_ref = base_ref if base_ref is not None else merged_hf_model(model, None, 1.0, torch.float32)
    zero = {k: (torch.zeros_like(v) if ".lora_B." in k else v) for k, v in peft.items()}
    ref = merged_hf_model(model, peft, scale, torch.float32)
    ref_served = with_expert_weights(merged_hf_model(model, peft, scale, torch.float32),
                                     served_expert_weights(model, arch, peft, rank, alpha, torch.bfloat16))
    llm.collective_rpc("moe_lora_clear")
    llm.reset_prefix_cache()
    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, seed=seed, ignore_eos=True)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in
            zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))]
    start = len(prompts[0]) - 1                        # positions predicting the continuation
    lp_ref, lp_base, lp_served = hf_logprobs(ref, seqs), hf_logprobs(base_ref, seqs), hf_logprobs(ref_served, seqs)

    def engine():
        llm.reset_prefix_cache()
        return full_logprobs(llm, seqs, V)
    row = {"base_kernel": kl(engine(), lp_base, start), "merged_rounding": kl(lp_served, lp_ref, start),
           **expert_part(model, arch, peft, rank, alpha, seqs, start, lp_base, lp_ref, negative_control)}
    version = first_version
    for mode in ("merged", "unmerged"):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        if mode == "unmerged":
            InprocTransport(llm).push(version, zero, rank, alpha)
            version += 1
            row["base_torch"] = kl(engine(), lp_base, start)
            if negative_control:
                fixed = moe_torch._expert_mlp
                moe_torch._expert_mlp = expert_mlp_rounded_outputs
                try:
                    row["base_torch_rounded"] = kl(engine(), lp_base, start)
                    InprocTransport(llm).push(version, peft, rank, alpha)
                    version += 1
                    row["unmerged_rounded"] = kl(engine(), lp_ref, start)
                finally:
                    moe_torch._expert_mlp = fixed
        InprocTransport(llm).push(version, peft, rank, alpha)
        version += 1
        got = engine()
        row[mode] = kl(got, lp_ref, start)
        if mode == "merged":
            row["merged_kernel"] = kl(got, lp_served, start)
    rt = llm.collective_rpc("_moe_lora_runtime")[0]             # the in-process engine's runtime object
    llm.collective_rpc("moe_lora_clear")
    precision = rt.expert_precision
    rt.set_expert_precision("fp32")
    try:
        InprocTransport(llm).push(version, zero, rank, alpha)
        row["base_torch_fp32"] = kl(engine(), lp_base, start)
        InprocTransport(llm).push(version + 1, peft, rank, alpha)
        row["unmerged_fp32"] = kl(engine(), lp_ref, start)
    finally:
        llm.collective_rpc("moe_lora_clear")
        rt.set_expert_precision(precision)
    InprocTransport(llm).push(version + 2, peft, rank, alpha)
    row["refs"] = (ref, base_ref)
    return row


def main(argv=None) -> dict:
    set_engine_env()
    import torch

    from ...models.arch import load_arch
    from ...transfer.transports import InprocTransport
    from ...checks.route_reference import merged_hf_model, random_expert_adapter
    from .serve_engine import ENGINE

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--std", type=float, default=0.2)
    ap.add_argument("--n", type=int, default=8, help="sequences per seed")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--mc-prompts", type=int, default=4, help="prompts of bench serve's Monte-Carlo KL (0: off)")
    ap.add_argument("--negative-control", action="store_true",
                    help="also serve unmerged with the pre-fix arithmetic (expert_mlp_rounded_outputs)")
    a = ap.parse_args(argv)
    arch = load_arch(a.model)
    rank, alpha = a.rank, 2.0 * a.rank
    V = arch.vocab_size
    llm = make_engine(a.model, prefix_caching=False, max_logprobs=V, **ENGINE)
    base_ref = merged_hf_model(a.model, None, 1.0, torch.float32)
    rows = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        g = torch.Generator().manual_seed(1000 + seed)
        prompts = torch.randint(0, V, (a.n, a.prompt_len), generator=g).tolist()
        peft = random_expert_adapter(arch, rank, seed=seed, std=a.std)
        row = kl_decomposition(llm, a.model, arch, peft, rank, alpha, prompts, a.gen_len, seed, 100 * seed + 1,
                               base_ref, a.negative_control)
        ref, _ = row.pop("refs")
        skipped = row.pop("skipped", {})
        if a.mc_prompts:
            for mode in ("merged", "unmerged"):
                llm.collective_rpc("moe_lora_clear")
                llm.collective_rpc("moe_lora_set_mode", args=(mode,))
                InprocTransport(llm).push(100 * seed + 50 + len(mode), peft, rank, alpha)
                row[f"kl_mc_{mode}"], row[f"kl_mc_se_{mode}"] = mc_kl(llm, ref, prompts[:a.mc_prompts], a.gen_len,
                                                                      seed + 1)
        row = {"seed": seed, **row}
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k != "seed" and k not in skipped]
    summary = {k: {"mean": sum(r[k] for r in rows) / len(rows), "min": min(r[k] for r in rows),
                   "max": max(r[k] for r in rows)} for k in keys}
    res = {"model": a.model, "rows": rows, "summary": summary, "skipped": skipped}
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
