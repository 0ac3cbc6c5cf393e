"""torchrun worker: Megatron (each layout) vs HF transformers, max |fp32 logit diff| per model."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..megatron import cpu_support
from ..megatron.build import build_model
from ..megatron.forward import forward_logits
from ..megatron.hf_reference import hf_logits, load_arch
from ..megatron.layout import Layout
from ..megatron.load import load_hf_weights
from ..megatron.parallel import init_distributed, teardown
from ..testing.launch import finish_worker


def sample_tokens(vocab: int, batch: int = 2, seq: int = 32, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--grouped", action="store_true", help="legacy GroupedMLP experts (megatron-core 0.16)")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    cpu_support.apply()
    torch.manual_seed(0)
    out: dict = {}
    for key in a.layouts.split(","):
        layout = Layout.parse(key)
        init_distributed(layout)
        for path in a.models.split(","):
            arch = load_arch(path)
            model = build_model(arch, layout, grouped_experts=a.grouped)
            load_hf_weights(model, path, arch)
            tokens = sample_tokens(arch.vocab_size)
            logits = forward_logits(model, tokens, arch.vocab_size)
            diff = torch.tensor(-1.0)
            if logits is not None:
                diff = (logits - hf_logits(path, tokens)).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            out.setdefault(key, {})[path] = float(diff)
            del model
        teardown()
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
