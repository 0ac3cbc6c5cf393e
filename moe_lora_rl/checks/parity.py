"""Parity: Megatron at each layout (the run config's dtype) vs HF transformers fp32 (checks/hf.py), per model.

    run(models, layouts, rc)    one torchrun launch of this module per world size; the worst error per layout
    python -m moe_lora_rl.checks.parity (torchrun worker): per layout and model the max |logit diff| and the
        median over tokens of each token's max |logit diff| relative to max |ref| (tolerances.PARITY_*), with a
        negative control (the same metric against the reference one position later must fail)
"""
from __future__ import annotations

import torch

from .launch import run_torchrun, worker_arg
from .layouts import check_layouts, group_by_world
from .tolerances import PARITY_BF16, PARITY_FP32


def sample_tokens(vocab: int, batch: int = 2, seq: int = 32, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |logit diff|, and the median over tokens of each token's max |logit diff| relative to max |ref| (robust
    to the few tokens whose top-k routing flips under bf16 rounding)."""
    per_token = (got - ref).abs().amax(-1).flatten()
    scale = ref.abs().max()
    return {"max_abs": float(per_token.max()), "rel_median_token": float(per_token.median() / scale),
            "ref_max_abs": float(scale)}


def run(models: list[str], layouts: str, rc=None) -> dict:
    from ..megatron.run_config import RunConfig

    rc = rc or RunConfig()
    check_layouts(models, layouts)                     # bad layouts fail here, before any process starts
    details: dict[str, dict[str, dict]] = {}
    for world, names in group_by_world(layouts).items():
        details.update(run_torchrun("moe_lora_rl.checks.parity", world,
                                    ["--models", ",".join(models), "--layouts", ",".join(names), *worker_arg(rc)]))
    key, target = ("max_abs", PARITY_FP32) if rc.dtype == "fp32" else ("rel_median_token", PARITY_BF16)
    per_layout = {name: {m: r[key] for m, r in d.items()} for name, d in details.items()}
    worst = {name: max(d.values()) for name, d in per_layout.items()}
    out = {"layouts": worst, "max_abs_diff" if rc.dtype == "fp32" else "max_rel_median_token": max(worst.values()),
           "models": models, "per_model": per_layout, "target": target, "metric": key, "dtype": rc.dtype}
    if rc.dtype != "fp32":
        out["details"] = details
    return out


def main(argv=None):
    import torch.distributed as dist

    from ..megatron.forward import forward_logits
    from ..policy.model import build_from_hf
    from .hf import hf_logits
    from .launch import each_model_at_layout, finish_worker, worker_args

    def add(ap):
        ap.add_argument("--grouped", action="store_true", help="legacy GroupedMLP experts (megatron-core 0.16)")

    a = worker_args(argv, add, models_at_layouts=True)
    torch.manual_seed(0)
    out: dict = {}
    for key, layout, _, path in each_model_at_layout(a):
        arch, model = build_from_hf(path, layout, a.rc, grouped_experts=a.grouped)
        tokens = sample_tokens(arch.vocab_size)
        logits = forward_logits(model, tokens, arch.vocab_size)
        rec = {"max_abs": -1.0, "rel_median_token": -1.0, "ref_max_abs": -1.0, "control": -1.0}
        if logits is not None:
            ref = hf_logits(path, tokens)
            rec = token_errors(logits, ref)
            rec["control"] = token_errors(logits[:, :-1], ref[:, 1:])["rel_median_token"]
        vals = torch.tensor([rec[k] for k in sorted(rec)])
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        out.setdefault(key, {})[path] = dict(zip(sorted(rec), vals.tolist()))
        del model
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
