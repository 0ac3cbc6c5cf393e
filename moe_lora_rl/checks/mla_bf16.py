"""python -m moe_lora_rl.checks.mla_bf16 --model DIR: where a bf16 engine's KL to the fp32 reference comes from, by
position, with the engine's own routes replayed in the reference (R3) and without (one bf16 engine, any family).

    bf16 engine (routes captured) -> full distributions at every position: prompt positions (prefill) and decoded
    tokens (decode), one request per sequence -> exact KL(engine || reference) per position, mean over sequences:

    engine_free       vs HF fp32 routing itself                    (bench serve's kl_exact_base_kernel)
    engine_replayed   vs HF fp32 forced to the engine's routes     (what the trainer sees with R3)
    hf_bf16_free      HF bf16 vs HF fp32, each routing itself      (the same rounding without the engine)
    hf_bf16_replayed  HF bf16 vs HF fp32, both forced to the engine's routes

reported in bands: position 0 (attends to itself only), 1-7, 8 to the prompt's end (prefill), decode; with
route_agreement (fraction of (token, MoE layer) top-k sets the engine shares with HF fp32's routers). On a plain-RoPE
MLA checkpoint the same again with the CPU rotary fix undone (vllm/rope_fix.restore; the negative control: a rotary
fault shows at positions > 0 in the replayed KL, which routing flips cannot explain). Prints "RESULT <json>".
"""
from __future__ import annotations

import argparse
import json
import sys

from ..rollout.vllm_engine import make_engine, set_engine_env
from ..rollout.generate import capturing


def kl_per_position(pairs) -> "torch.Tensor":
    """[(p_log [T, V], q_log [T, V]), ...] -> [T] mean over the pairs of KL(p || q) (natural log)."""
    import torch

    return torch.stack([(p.exp() * (p - q)).nan_to_num(0.0).sum(-1) for p, q in pairs]).mean(0)


def bands(v, prompt_len: int) -> dict:
    """Per-position values [T] (T = prompt_len + gen_len - 1) -> the bands of the module docstring and the max."""
    return {"pos0": float(v[0]), "1-7": float(v[1:8].mean()), "prefill_8+": float(v[8:prompt_len - 1].mean()),
            "decode": float(v[prompt_len - 1:].mean()), "max": float(v.max())}


def measure(llm, refs, prompts: list[list[int]], gen_len: int, moe_layers: list[int]) -> dict:
    """One bf16 generation (temperature 1, seed 1) of every prompt with full distributions and captured routes; the
    four KLs of the module docstring in bands, and route_agreement. refs: (HF fp32, HF bf16)."""
    import numpy as np
    import torch
    from vllm import SamplingParams

    from .forced_routes import forced_logits
    from .route_reference import agreement, hf_routes

    ref32, ref16 = refs
    V, P = ref32.config.vocab_size, len(prompts[0])
    T = P + gen_len - 1
    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, seed=1, ignore_eos=True,
                        logprobs=V, prompt_logprobs=V)
    with capturing(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        routes = llm.collective_rpc("moe_lora_capture_pop", args=([o.request_id for o in outs],))[0]
    pairs: dict[str, list] = {k: [] for k in ("engine_free", "engine_replayed", "hf_bf16_free", "hf_bf16_replayed")}
    agree = []
    for p, o in zip(prompts, outs):
        eng = torch.full((T, V), float("-inf"), dtype=torch.float64)
        for j, d in enumerate((list(o.prompt_logprobs[1:]) + list(o.outputs[0].logprobs))[:T]):
            for t, lp in d.items():
                eng[j, t] = lp.logprob
        toks = torch.tensor(p + list(o.outputs[0].token_ids)[:-1])
        r = np.asarray(routes[o.request_id])
        if r.shape[0] != T:
            raise RuntimeError(f"captured routes for {r.shape[0]} tokens, expected {T}")
        lsm = lambda x: torch.log_softmax(x.double(), -1)  # noqa: E731
        with torch.no_grad():
            free32, free16 = (lsm(m(input_ids=toks[None]).logits[0]) for m in refs)
        rep32, rep16 = (lsm(forced_logits(m, toks, r)[0]) for m in refs)
        pairs["engine_free"].append((eng, free32))
        pairs["engine_replayed"].append((eng, rep32))
        pairs["hf_bf16_free"].append((free16, free32))
        pairs["hf_bf16_replayed"].append((rep16, rep32))
        agree.append(agreement([np.sort(r, -1)], hf_routes(ref32, moe_layers, [toks.tolist()])))
    out = {k: bands(kl_per_position(v), P) for k, v in pairs.items()}
    out["route_agreement"] = float(np.mean(agree))
    return out


def run(model: str, n: int = 8, prompt_len: int = 32, gen_len: int = 32, control: bool = True) -> dict:
    import torch

    from ..models.arch import load_arch
    from ..vllm import rope_fix
    from .forced_routes import reference_model

    arch = load_arch(model)
    V = arch.vocab_size
    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    llm = make_engine(model, dtype="bfloat16", prefix_caching=False, max_logprobs=V, max_model_len=512, seed=0,
                      block_size=32)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    prompts = torch.randint(0, V, (n, prompt_len), generator=torch.Generator().manual_seed(1001)).tolist()
    refs = (reference_model(model, torch.float32), reference_model(model, torch.bfloat16))
    routed = worker._moe_lora_model_fixes["mla_rope_routed"]
    res = {"model": model, "rope_routed": routed, "n": n, "prompt_len": prompt_len, "gen_len": gen_len,
           "fixed": measure(llm, refs, prompts, gen_len, moe)}
    if control and routed:
        rope_fix.restore(worker.model_runner.model)
        try:
            res["rope_fix_undone"] = measure(llm, refs, prompts, gen_len, moe)
        finally:
            rope_fix.apply(worker.model_runner.model)
    del llm
    return res


def main(argv=None) -> dict:
    set_engine_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=8, help="sequences")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--no-control", action="store_true", help="skip the rope-fix-undone pass")
    a = ap.parse_args(argv)
    if a.prompt_len < 10 or a.gen_len < 1 or a.n < 1:
        print(f"mla_bf16: --prompt-len {a.prompt_len} (>= 10), --gen-len {a.gen_len} (>= 1), --n {a.n} (>= 1) "
              "expected", file=sys.stderr)
        raise SystemExit(2)
    res = run(a.model, a.n, a.prompt_len, a.gen_len, control=not a.no_control)
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
