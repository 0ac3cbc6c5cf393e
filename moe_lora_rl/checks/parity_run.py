"""Parity: Megatron at each layout (the run config's dtype) vs HF transformers fp32 (checks/hf.py), per model.

    run(models, layouts, rc)    one torchrun launch of this module per world size; the worst error per layout
    python -m moe_lora_rl.checks.parity_run (torchrun worker): per layout and model the max |logit diff| and the
        median over tokens of each token's max |logit diff| relative to max |ref| (tolerances.PARITY_*), with a
        negative control (the same metric against the reference one position later must fail); for an MLA model
        at the unsharded layout also the max |logit diff| of two wrong builds (mla_controls): without the latent
        norms (qk_layernorm False: the local spec's IdentityOp) and, for a yarn model, with plain RoPE
"""
from __future__ import annotations

import torch

from .torchrun import run_torchrun, worker_arg
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
        details.update(run_torchrun("moe_lora_rl.checks.parity_run", world,
                                    ["--models", ",".join(models), "--layouts", ",".join(names), *worker_arg(rc)]))
    key, target = ("max_abs", PARITY_FP32) if rc.dtype == "fp32" else ("rel_median_token", PARITY_BF16)
    per_layout = {name: {m: r[key] for m, r in d.items()} for name, d in details.items()}
    worst = {name: max(d.values()) for name, d in per_layout.items()}
    out = {"layouts": worst, "max_abs_diff" if rc.dtype == "fp32" else "max_rel_median_token": max(worst.values()),
           "models": models, "per_model": per_layout, "target": target, "metric": key, "dtype": rc.dtype}
    controls = {name: {m: {k[len("mla:"):]: v for k, v in r.items() if k.startswith("mla:")} for m, r in d.items()}
                for name, d in details.items()}
    controls = {name: {m: c for m, c in d.items() if c} for name, d in controls.items()}
    if any(controls.values()):
        out["mla_controls"] = {name: d for name, d in controls.items() if d}
    if rc.dtype != "fp32":
        out["details"] = details
    return out


def _mla_controls(arch, layout) -> dict:
    """Wrong MLA builds whose parity must fail (config overrides by name), at the unsharded layout only."""
    if not arch.mla or layout.tp * layout.pp * layout.ep * layout.etp != 1:
        return {}
    out = {"no_latent_norms": {"qk_layernorm": False}}
    if arch.rope_type == "yarn":
        out["plain_rope"] = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    return out


def main(argv=None):
    import torch.distributed as dist

    from ..megatron.forward import forward_logits
    from ..policy.model import build_from_hf
    from .hf import hf_logits
    from .torchrun import each_model_at_layout, finish_worker, worker_args

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
        wrong = _mla_controls(arch, layout)
        rec.update({f"mla:{k}": -1.0 for k in wrong})
        ref = hf_logits(path, tokens) if logits is not None or wrong else None
        if logits is not None:
            rec.update(token_errors(logits, ref))
            rec["control"] = token_errors(logits[:, :-1], ref[:, 1:])["rel_median_token"]
        for k, overrides in wrong.items():
            del model
            _, model = build_from_hf(path, layout, a.rc, **overrides)
            got = forward_logits(model, tokens, arch.vocab_size)
            if got is not None:
                rec[f"mla:{k}"] = float((got - ref).abs().max())
        vals = torch.tensor([rec[k] for k in sorted(rec)])
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        out.setdefault(key, {})[path] = dict(zip(sorted(rec), vals.tolist()))
        del model
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
