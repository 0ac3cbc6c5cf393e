"""python -m kit.mla_serve --models DIR[,DIR] (tests/e2e/test_mla_vllm.py): vLLM's CPU engine on
DeepSeek-V3-architecture (MLA) checkpoints against HF transformers, fp32, one engine per checkpoint.

    rope        the base model: prompt logprobs (positions > 0) and greedy decode (tokens, their logprobs) vs HF;
                then the plain-RoPE fix undone (vllm/rope_fix.restore), the same (negative control), and re-applied
    modules     per serving mode (merged / unmerged) and per adapter (LoRA on one module alone: each MLA linear the
                model has, the routed experts, the shared expert; then all of them at once): the engine serving it vs
                HF with the same adapter merged (W + s * B @ A, the PEFT reference), on prompt positions (prefill)
                and on decoded tokens (MLA's absorbed decode, where a kv_b_proj delta applied only to the layer would
                be lost): max |logprob diff|, k3, greedy tokens equal; and how far the adapter moves the engine's and
                the reference's prompt logprobs from the base model's (a module the engine drops moves nothing). k3 is
                mean(exp(d) - 1 - d), d = reference - engine logprob, over the decoded (sampled) tokens as the
                trainer's k3 is (k3_all: over prompt positions too, whose random tokens sit at log p ~ -10)
    routes      R3 capture while serving every module: captured top-k sets vs HF's router at every token and layer
    absorbed    first, each kv_b_proj.weight is replaced by a copy, so W_UK_T / W_UV no longer share its storage (in an
                fp32 engine they are views of it, and an in-place merge would reach decode by accident; in bf16 they
                are copies): every result then needs the re-derivation. Negative control: a kv_b_proj adapter served
                with the re-derivation disabled is right in prefill and wrong in decode

A checkpoint's config.json may lack topk_method / scoring_func (the engine fills them in). Prints "RESULT <json>".
"""
from __future__ import annotations

import argparse
import json

from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
from moe_lora_rl.rollout.generate import captured_generate, capturing

RANK, ALPHA = 4, 8.0
EXPERTS = ("mlp.experts.{E}.gate_proj", "mlp.experts.{E}.up_proj", "mlp.experts.{E}.down_proj")
SHARED = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
MLA_MODULES = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.q_proj", "self_attn.kv_a_proj_with_mqa",
               "self_attn.kv_b_proj", "self_attn.o_proj")


def module_adapter(arch, modules: tuple[str, ...], seed: int, std: float = 0.1) -> dict:
    """PEFT tensors (rank RANK) on these HF modules (under model.layers.L., experts with {E}) in every layer that
    has them."""
    import torch

    from moe_lora_rl.models.naming import naming_for

    naming, g, out = naming_for(arch), torch.Generator().manual_seed(seed), {}
    for layer in range(arch.num_layers):
        shapes = naming.hf_shapes(arch, layer)
        for m in modules:
            if m not in shapes:
                continue
            din, dout = shapes[m]
            for e in range(arch.num_experts) if "{E}" in m else [None]:
                p = f"base_model.model.model.layers.{layer}." + (m if e is None else m.replace("{E}", str(e)))
                out[f"{p}.lora_A.weight"] = torch.randn(RANK, din, generator=g) * std / din ** 0.5
                out[f"{p}.lora_B.weight"] = torch.randn(dout, RANK, generator=g) * std / RANK ** 0.5
    return out


def adapters_for(arch) -> dict[str, dict]:
    from moe_lora_rl.models.naming import naming_for

    have = set(naming_for(arch).hf_shapes(arch, 0)) | set(naming_for(arch).hf_shapes(arch, arch.num_layers - 1))
    table = {m.split(".")[-1]: (m,) for m in MLA_MODULES if m in have}
    table.update(experts=EXPERTS, shared_expert=SHARED)
    out = {name: module_adapter(arch, mods, seed=i + 1) for i, (name, mods) in enumerate(table.items())}
    # every module at once at half the std: its effect stays of the single-module adapters' size (fp32 logprob errors
    # grow with the logits' magnitude)
    out["all"] = module_adapter(arch, tuple(m for mods in table.values() for m in mods), seed=100, std=0.05)
    return out


def engine_run(llm, prompts: list[list[int]], gen_len: int, meta=None):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=0, logprobs=0, prompt_logprobs=0,
                        ignore_eos=True)
    return captured_generate(llm, prompts, sp, meta)


def eos_ids(ref) -> list[int]:
    """The end-of-sequence ids the engine's min_tokens masks before it samples (the model's config and generation
    config): HF's greedy choice is taken over the other ids."""
    ids = set()
    for cfg in (getattr(ref, "generation_config", None), getattr(ref, "config", None)):
        e = getattr(cfg, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
    return sorted(ids)


def compare(gens, ref) -> dict:
    """Engine vs a HF model teacher-forced on the engine's own sequences: prompt positions > 0 and decoded tokens;
    greedy_equal: every decoded token is HF's argmax over what the engine may sample (min_tokens masks eos_ids)."""
    import torch

    d_prompt, d_decode, greedy = [], [], True
    eos = eos_ids(ref)
    ref_prompt = []
    for g in gens:
        toks = list(g.prompt) + list(g.response)
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([toks])).logits[0].double(), -1)
        n = len(g.prompt)
        want = lp[:-1].gather(-1, torch.tensor(toks[1:])[:, None])[:, 0]
        d_prompt.append(want[:n - 1] - torch.tensor(g.prompt_logprobs, dtype=torch.float64))
        d_decode.append(want[n - 1:] - torch.tensor(g.logprobs, dtype=torch.float64))
        allowed = lp[n - 1:-1].clone()
        allowed[:, eos] = float("-inf")
        greedy &= allowed.argmax(-1).tolist() == list(g.response)
        ref_prompt.append(want[:n - 1])
    d, d_all = torch.cat(d_decode), torch.cat(d_prompt + d_decode)
    return {"prompt_max": torch.cat(d_prompt).abs().max().item(), "decode_max": d.abs().max().item(),
            "k3": (d.exp() - 1 - d).mean().item(), "k3_all": (d_all.exp() - 1 - d_all).mean().item(), "greedy_equal": bool(greedy), "_ref_prompt": torch.cat(ref_prompt),
            "_eng_prompt": torch.cat([torch.tensor(g.prompt_logprobs, dtype=torch.float64) for g in gens])}


def serve_adapter(llm, tr, version: int, name: str, peft: dict, ref, base: dict, prompts, gen_len: int, moe,
                  table: dict, mode: str, on_all=None) -> dict:
    """Push `peft` as `version`, generate, compare with `ref` (HF with it merged) and record how far the engine's and
    the reference's prompt log-probs moved from the base run's; the "all" adapter also checks the captured routes
    against HF's router (table["routes_MODE"]) and runs on_all(). The comparison, also stored as table["NAME/MODE"]."""
    from moe_lora_rl.checks.route_reference import agreement, hf_routes

    tr.push(version, peft, RANK, ALPHA)
    if name == "all":
        with capturing(llm) as meta:
            gens = engine_run(llm, prompts, gen_len, meta)
        seq = [g.tokens[:-1] for g in gens]
        table[f"routes_{mode}"] = agreement([g.routes for g in gens], hf_routes(ref, moe, seq))
        if on_all is not None:
            on_all()
    else:
        gens = engine_run(llm, prompts, gen_len)
    c = compare(gens, ref)
    c["engine_moved"] = (c["_eng_prompt"] - base["_eng_prompt"]).abs().max().item()
    c["ref_moved"] = (c["_ref_prompt"] - base["_ref_prompt"]).abs().max().item()
    table[f"{name}/{mode}"] = {k: v for k, v in c.items() if not k.startswith("_")}
    return c


def run_model(model: str, seqs: int, prompt_len: int, gen_len: int) -> dict:
    import torch

    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.vllm import rope_fix
    from moe_lora_rl.checks.route_reference import merged_hf_model

    arch = load_arch(model)
    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    prompts = torch.randint(3, arch.vocab_size, (seqs, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    llm = make_engine(model, dtype="float32", prefix_caching=False, max_model_len=256)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    _unalias_kv_b(worker.model_runner.model)
    base_ref = merged_hf_model(model, None, 1.0, torch.float32)
    res: dict = {"model": model, "q_lora_rank": arch.q_lora_rank, "rope_type": arch.rope_type,
                 "rope_routed": worker._moe_lora_model_fixes["mla_rope_routed"]}

    base = compare(engine_run(llm, prompts, gen_len), base_ref)
    rope_fix.restore(worker.model_runner.model)
    unfixed = compare(engine_run(llm, prompts, gen_len), base_ref)
    rope_fix.apply(worker.model_runner.model)
    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    res["base"], res["base_unfixed"] = strip(base), strip(unfixed)

    tr, version, table = InprocTransport(llm), 0, {}
    adapters = adapters_for(arch)
    refs = {name: merged_hf_model(model, peft, ALPHA / RANK, torch.float32) for name, peft in adapters.items()}
    for mode in ("merged", "unmerged"):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        for name, peft in adapters.items():
            version += 1
            serve_adapter(llm, tr, version, name, peft, refs[name], base, prompts, gen_len, moe, table, mode)
    res["pin_kv_b_refused"] = _pin_refusal(worker, tr, version + 1, adapters["kv_b_proj"])
    res["kv_b_not_reabsorbed"] = _not_reabsorbed(worker, llm, tr, version + 2, adapters["kv_b_proj"], prompts, gen_len,
                                                 refs["kv_b_proj"])
    llm.collective_rpc("moe_lora_clear")
    res["served"] = table
    del llm
    return res


def _unalias_kv_b(model) -> None:
    """Each MLA layer's kv_b_proj.weight replaced by a copy: W_UK_T / W_UV keep the old storage (no-op without MLA)."""
    import torch

    from moe_lora_rl.vllm.mla_merge import mla_attention

    for layer in model.model.layers:
        attn = mla_attention(layer)
        if attn is not None:
            attn.kv_b_proj.weight = torch.nn.Parameter(attn.kv_b_proj.weight.detach().clone(), requires_grad=False)


def _not_reabsorbed(worker, llm, tr, version: int, peft: dict, prompts, gen_len: int, ref) -> dict:
    """Negative control: kv_b_proj merged with W_UK_T / W_UV left as they were (the attention layers'
    process_weights_after_loading disabled for this push)."""
    attns = list(worker._moe_lora_runtime()._kv_b().attn.values())
    for a in attns:
        a.process_weights_after_loading = lambda dtype: None
    try:
        tr.push(version, peft, RANK, ALPHA)
    finally:
        for a in attns:
            del a.process_weights_after_loading
    c = compare(engine_run(llm, prompts, gen_len), ref)
    return {k: v for k, v in c.items() if not k.startswith("_")}


def _pin_refusal(worker, tr, version: int, peft: dict) -> dict:
    """A kv_b_proj adapter pushed to a runtime holding several versions per batch (inflight='pin') is refused in one
    line and the served version stays."""
    from moe_lora_rl.vllm.versions import VersionTable, check_inflight_config

    rt = worker._moe_lora_runtime()
    saved, served = rt.table, rt.status()["version"]
    rt.table = VersionTable(check_inflight_config("unmerged", "pin", 2, "refuse"))
    try:
        tr.push(version, peft, RANK, ALPHA)
        msg = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        msg = " ".join(str(e).split())
    finally:
        rt.table = saved
    return {"message": msg[:400], "served_before": served, "served_after": rt.status()["version"]}


def main(argv=None) -> dict:
    set_engine_env()
    p = argparse.ArgumentParser()
    p.add_argument("--models", required=True, help="comma-separated checkpoint directories")
    p.add_argument("--seqs", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--gen-len", type=int, default=6)
    a = p.parse_args(argv)
    return {"models": [run_model(m, a.seqs, a.prompt_len, a.gen_len) for m in a.models.split(",")]}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
