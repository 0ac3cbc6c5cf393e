"""python -m kit.hybrid_serve --model DIR (tests/e2e/test_hybrid_vllm.py): vLLM's CPU engine on the hybrid
linear-attention family (Qwen3.5/3.6-MoE, Qwen3-Next) against HF transformers, fp32, one engine, every check on it;
the same checks as kit.mla_serve (its adapters, engine runs and comparison are reused).

    base        prompt logprobs (positions > 0) and greedy decode vs HF: the delta-net layers run the fp32 torch core
                (vllm/gdn_torch.py); last of all, with it undone, the engine refuses a request (vLLM's CPU GDN op is
                bf16-only): the message is recorded
    modules     per serving mode (merged / unmerged) and per adapter on one module group alone (the routed experts,
                the shared expert, o_proj; and by vLLM module, ready for the delta-net / gated-attention targets:
                in_proj_qkvz (in_proj_qkv, in_proj_z), in_proj_ba (in_proj_b, in_proj_a), out_proj, qkv_proj
                (q_proj with its gate half, k_proj, v_proj)), then all at once: engine vs HF with the adapter merged,
                prompt and decode; how far each adapter moves the engine's and the reference's prompt logprobs
    dropped     per mode and group: the all-modules adapter pushed without that group's tensors, against the full
                reference (a module the engine dropped: the check must fail)
    routes      R3 capture while serving every module: captured top-k vs HF's router at every token and MoE layer
    chunked     a prompt longer than the step's token budget (max_num_batched_tokens), prefilled in chunks (the
                conv and SSM state carried between chunks), vs HF, under the all-modules adapter
    prefix      prefix caching on (vLLM's mamba_cache_mode 'align'): a request whose prefix the previous one cached
                (attention blocks and the recurrent state at the block boundary) vs HF, under the all-modules adapter
    preempted   a second engine with a 9-block KV pool: vLLM preempts and resumes requests by recompute; their decoded
                tokens vs HF under the all-modules adapter

Prints "RESULT <json>".
"""
from __future__ import annotations

import argparse
import json
import re

from kit.mla_serve import ALPHA, EXPERTS, RANK, compare, engine_run, eos_ids, module_adapter, serve_adapter
from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env

SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")
GROUPS = {                      # name: HF modules (the engine serves each group on the vLLM module named)
    "experts": EXPERTS, "shared_expert": SHARED, "o_proj": ("self_attn.o_proj",),
    "in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "out_proj": ("linear_attn.out_proj",),
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
}
GROUPS_NEXT = {**GROUPS, "in_proj_qkvz": ("linear_attn.in_proj_qkvz",), "in_proj_ba": ("linear_attn.in_proj_ba",)}


def groups_for(arch) -> dict[str, tuple[str, ...]]:
    from moe_lora_rl.models.naming import naming_for

    naming = naming_for(arch)
    have = {m for li in range(arch.num_layers) for m in naming.hf_shapes(arch, li)}
    table = GROUPS_NEXT if "linear_attn.in_proj_qkvz" in have else GROUPS
    return {k: v for k, v in table.items() if set(v) <= have}


def prefix_check(llm, shared: list[int], gen_len: int, ref) -> dict:
    """Two requests sharing a prefix, one after the other (decode logprobs only: a request asking for prompt
    logprobs does not read the cache): the second reads the first's blocks, the recurrent state at the last full
    block included (mamba_cache_mode 'align'); its decoded tokens vs HF on the whole sequence."""
    import torch
    from vllm import SamplingParams

    from moe_lora_rl.rollout.generate import captured_generate

    def hits():
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")

    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=0, logprobs=0, ignore_eos=True)
    captured_generate(llm, [shared + [5, 6, 7]], sp)
    before = hits()
    [gen] = captured_generate(llm, [shared + [9, 10, 11, 12]], sp)
    toks = list(gen.prompt) + list(gen.response)
    with torch.no_grad():
        lp = torch.log_softmax(ref(input_ids=torch.tensor([toks])).logits[0].double(), -1)
    n = len(gen.prompt)
    want = lp[n - 1:-1].gather(-1, torch.tensor(gen.response)[:, None])[:, 0]
    return {"hit_tokens": int(hits() - before), "prefix_len": len(shared),
            "decode_max": (want - torch.tensor(gen.logprobs, dtype=torch.float64)).abs().max().item(),
            "greedy_equal": lp[n - 1:-1].argmax(-1).tolist() == list(gen.response)}


TIE = 1e-4
"""A greedy step whose HF top-1 beats the engine's token by at most this many nats counts as a tie."""


def preemption_check(model: str, peft: dict, ref, text_only: dict, n: int = 8, prompt_len: int = 100,
                     gen_len: int = 100, blocks: int = 9) -> dict:
    """A second engine with a KV pool of `blocks` blocks (prefix caching off), so vLLM preempts running requests and
    resumes them by recompute (their conv / SSM state dropped, their tokens prefilled again): n greedy requests under
    the all-modules adapter (unmerged), each decoded token vs HF. Preemptions counted on the scheduler (its
    _preempt_request wrapped on this engine's instance)."""
    import torch
    from vllm import SamplingParams

    from moe_lora_rl.rollout.generate import captured_generate
    from moe_lora_rl.transfer.transports import InprocTransport

    llm = make_engine(model, dtype="float32", prefix_caching=False, max_model_len=256, num_gpu_blocks_override=blocks,
                      **text_only)
    InprocTransport(llm).push(1, peft, RANK, ALPHA)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    count, preempt = [0], sched._preempt_request

    def counted(*args, **kw):
        count[0] += 1
        return preempt(*args, **kw)
    sched._preempt_request = counted
    prompts = torch.randint(3, 500, (n, prompt_len), generator=torch.Generator().manual_seed(7)).tolist()
    sp = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=0, logprobs=0, ignore_eos=True)
    gens = captured_generate(llm, prompts, sp)
    worst, same, ties, widest = 0.0, True, 0, 0.0
    eos = eos_ids(ref)
    for g in gens:
        toks = list(g.prompt) + list(g.response)
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([toks])).logits[0].double(), -1)
        k = len(g.prompt)
        want = lp[k - 1:-1].gather(-1, torch.tensor(g.response)[:, None])[:, 0]
        worst = max(worst, (want - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max().item())
        # greedy: the engine's token is HF's argmax over what the engine may sample (min_tokens masks the end-of-
        # sequence ids), or within TIE of it (a near-tie that fp32 noise of the size compared above may flip)
        allowed = lp[k - 1:-1].clone()
        allowed[:, eos] = float("-inf")
        gap = allowed.max(-1).values - want
        same &= bool((gap <= TIE).all())
        ties += int(((gap > 0) & (gap <= TIE)).sum())
        widest = max(widest, gap.max().item())
    del llm
    return {"preemptions": count[0], "decode_max": worst, "greedy_equal": bool(same), "greedy_ties": ties,
            "greedy_gap_max": widest}


def _has_vision(model: str) -> bool:
    """The released layout (Qwen3_5MoeForConditionalGeneration): served as its text tower, no image or video input."""
    from pathlib import Path

    return "vision_config" in json.loads((Path(model) / "config.json").read_text())


def _strip(c: dict) -> dict:
    return {k: v for k, v in c.items() if not k.startswith("_")}


def run_model(model: str, seqs: int, prompt_len: int, gen_len: int, long_len: int, prefix_len: int) -> dict:
    import torch

    from moe_lora_rl.checks.route_reference import merged_hf_model
    from moe_lora_rl.models.arch import load_arch
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.vllm import gdn_torch

    arch = load_arch(model)
    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, arch.vocab_size, (seqs, prompt_len), generator=g).tolist()
    long_prompt = torch.randint(3, arch.vocab_size, (1, long_len), generator=g).tolist()
    budget = 32
    shared = torch.randint(3, arch.vocab_size, (prefix_len,), generator=g).tolist()
    text_only = {"limit_mm_per_prompt": {"image": 0, "video": 0}} if _has_vision(model) else {}
    llm = make_engine(model, dtype="float32", prefix_caching=True, max_model_len=256, max_num_batched_tokens=budget,
                      max_num_seqs=8, disable_log_stats=False, **text_only)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    net = worker.model_runner.model
    res: dict = {"model": model, "gdn_torch_layers": worker._moe_lora_model_fixes["gdn_torch_layers"]}
    base_ref = merged_hf_model(model, None, 1.0, torch.float32)
    base = compare(engine_run(llm, prompts, gen_len), base_ref)
    res["base"] = _strip(base)

    groups = groups_for(arch)
    adapters = {name: module_adapter(arch, mods, seed=i + 1) for i, (name, mods) in enumerate(groups.items())}
    adapters["all"] = module_adapter(arch, tuple(m for mods in groups.values() for m in mods), seed=100, std=0.05)
    refs = {name: merged_hf_model(model, peft, ALPHA / RANK, torch.float32) for name, peft in adapters.items()}
    tr, version, table, dropped = InprocTransport(llm), 0, {}, {}
    for mode in ("merged", "unmerged"):
        llm.collective_rpc("moe_lora_clear")
        llm.collective_rpc("moe_lora_set_mode", args=(mode,))
        for name, peft in adapters.items():
            version += 1

            def on_all(ref=refs[name], mode=mode):      # chunked prefill: the long prompt in steps of `budget` tokens
                table[f"chunked/{mode}"] = _strip(compare(engine_run(llm, long_prompt, gen_len), ref))
                table[f"prefix/{mode}"] = prefix_check(llm, shared, gen_len, ref)
            serve_adapter(llm, tr, version, name, peft, refs[name], base, prompts, gen_len, moe, table, mode, on_all)
        for name, mods in groups.items():       # the all-modules adapter with one group left out of the push
            version += 1
            drop = re.compile("|".join(r"\.layers\.\d+\." + re.escape(m).replace(r"\{E\}", r"\d+") + r"\.lora_"
                                       for m in mods))
            keep = {k: v for k, v in adapters["all"].items() if not drop.search(k)}
            assert len(keep) < len(adapters["all"]), name
            tr.push(version, keep, RANK, ALPHA)
            c = compare(engine_run(llm, prompts, gen_len), refs["all"])
            dropped[f"{name}/{mode}"] = max(c["prompt_max"], c["decode_max"])
    llm.collective_rpc("moe_lora_clear")
    res["served"], res["dropped"], res["groups"] = table, dropped, list(groups)
    gdn_torch.restore(net)               # last: the failed request is left in the engine, which is not used again
    try:
        engine_run(llm, prompts[:1], 1)
        res["base_unfixed_error"] = ""
    except Exception as e:  # noqa: BLE001 - the message is the result
        res["base_unfixed_error"] = " ".join(str(e).split())[:300]
    res["budget"], res["long_len"] = budget, long_len
    del llm
    import gc

    gc.collect()
    res["preempted"] = preemption_check(model, adapters["all"], refs["all"], text_only)
    return res


def main(argv=None) -> dict:
    set_engine_env()
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--seqs", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--gen-len", type=int, default=6)
    p.add_argument("--long-len", type=int, default=100)
    p.add_argument("--prefix-len", type=int, default=200)
    a = p.parse_args(argv)
    return run_model(a.model, a.seqs, a.prompt_len, a.gen_len, a.long_len, a.prefix_len)


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
