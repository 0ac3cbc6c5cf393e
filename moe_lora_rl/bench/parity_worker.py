"""torchrun worker: Megatron (each layout, the run config's dtype) vs HF transformers fp32, per model."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..policy.model import build_from_hf
from ..megatron.forward import forward_logits
from ..checks.hf import hf_logits
from ..megatron.layout import Layout
from ..megatron.parallel import init_distributed, teardown
from ..megatron.run_config import prepare_host
from ..checks.launch import finish_worker
from .run_args import from_worker_arg


def sample_tokens(vocab: int, batch: int = 2, seq: int = 32, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |logit diff|, and the median over tokens of each token's max |logit diff| relative to max |ref| (robust
    to the few tokens whose top-k routing flips under bf16 rounding)."""
    per_token = (got - ref).abs().amax(-1).flatten()
    scale = ref.abs().max()
    return {"max_abs": float(per_token.max()), "rel_median_token": float(per_token.median() / scale),
            "ref_max_abs": float(scale)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--grouped", action="store_true", help="legacy GroupedMLP experts (megatron-core 0.16)")
    ap.add_argument("--run-config", default="", help="RunConfig as JSON; default fp32 on CPU")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    rc = from_worker_arg(a.run_config)
    prepare_host(rc)
    torch.manual_seed(0)
    out: dict = {}
    for key in a.layouts.split(","):
        layout = Layout.parse(key)
        init_distributed(layout, rc)
        for path in a.models.split(","):
            arch, model = build_from_hf(path, layout, rc, grouped_experts=a.grouped)
            tokens = sample_tokens(arch.vocab_size)
            logits = forward_logits(model, tokens, arch.vocab_size)
            rec = {"max_abs": -1.0, "rel_median_token": -1.0, "ref_max_abs": -1.0, "control": -1.0}
            if logits is not None:
                ref = hf_logits(path, tokens)
                rec = token_errors(logits, ref)
                # negative control: the same metric against the reference one position later must fail
                rec["control"] = token_errors(logits[:, :-1], ref[:, 1:])["rel_median_token"]
            vals = torch.tensor([rec[k] for k in sorted(rec)])
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            out.setdefault(key, {})[path] = dict(zip(sorted(rec), vals.tolist()))
            del model
        teardown()
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
