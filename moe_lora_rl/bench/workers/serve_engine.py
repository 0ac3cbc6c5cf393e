"""What bench serve's worker and the serve test (tests/kit/serve_capture.py) share: the engines' settings, group
sampling as an RL trainer submits it (routes captured), and the fp32 check of one serving mode against HF
transformers with the adapter merged."""
from __future__ import annotations

from ...rollout.generate import captured_generate, capturing

ENGINE = dict(max_model_len=512, seed=0, block_size=32)      # both engines; bf16 adds prefix caching


def generate_groups(llm, prompts: list[list[int]], group: int, gen_len: int, seed: int, meta: dict | None):
    """group samples per prompt as separate requests (as an RL trainer submits them), seeds seed, seed + 1, ..."""
    from vllm import SamplingParams

    reqs = [p for p in prompts for _ in range(group)]
    params = [SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=1.0, ignore_eos=True, seed=seed + i)
              for i in range(len(reqs))]
    return captured_generate(llm, reqs, params, meta)


def fp32_check(llm, model: str, arch, peft, rank: int, alpha: float, version: int, *, n=4, length=48,
               seed=0) -> dict:
    """fp32 engine, one serving mode: prompt logprobs and routes of random sequences vs HF transformers with the
    adapter merged (fp32), and vs the same adapter perturbed (negative control)."""
    import torch
    from vllm import SamplingParams

    from ...transfer.transports import InprocTransport
    from ...checks.route_reference import agreement, hf_routes, merged_hf_model

    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    seqs = torch.randint(0, arch.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()
    served = InprocTransport(llm).push(version, peft, rank, alpha).served
    with capturing(llm) as meta:
        gens = captured_generate(llm, seqs, SamplingParams(max_tokens=1, prompt_logprobs=0), meta)
    got = torch.tensor([g.prompt_logprobs for g in gens], dtype=torch.float64)
    toks = torch.tensor(seqs)

    def ref_logprobs(p):
        m = merged_hf_model(model, p, alpha / rank, torch.float32)
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=toks).logits.double(), -1)
        return m, lp[:, :-1].gather(-1, toks[:, 1:, None])[..., 0]
    ref_model, want = ref_logprobs(peft)
    perturbed = {k: v * 1.1 if ".lora_B." in k else v for k, v in peft.items()}
    _, want_perturbed = ref_logprobs(perturbed)
    routes = [g.routes for g in gens]
    return {"logprob_max_diff": (got - want).abs().max().item(),
            "logprob_diff_perturbed": (got - want_perturbed).abs().max().item(),
            "agree_routes": agreement(routes, hf_routes(ref_model, moe, seqs)),
            "commit_s": served.get("commit_s"), "served": {k: served[k] for k in ("version", "mode")}}
