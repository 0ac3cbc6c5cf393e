"""torchrun worker: base (full fine-tuning) vs LoRA training steps on the same model and data, interleaved so both
see the same machine state. Reports medians."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ..lora import LoRAConfig, adapter_factors, sync_adapter_grads
from ..policy.model import build_from_hf
from ..megatron.forward import forward_logits
from ..megatron.layout import Layout
from ..megatron.parallel import init_distributed, teardown
from ..megatron.run_config import prepare_host
from .run_args import from_worker_arg
from ..megatron.train_step import lm_train_step


def _step(model, params, opt, tokens, vocab, sync):
    t0 = time.perf_counter()
    for p in params:
        p.grad = None
    lm_train_step(model, tokens, vocab, micro_batch_size=tokens.shape[0], after_backward=sync)
    opt.step()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", default="tp1ep1pp1")
    ap.add_argument("--lora", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--run-config", default="", help="RunConfig as JSON; default fp32 on CPU")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    rc = from_worker_arg(a.run_config)
    prepare_host(rc)
    layout = Layout.parse(a.layout)
    init_distributed(layout, rc)
    arch, base = build_from_hf(a.model, layout, rc)
    cfg = LoRAConfig.from_dict(json.loads(a.lora))
    _, lora = build_from_hf(a.model, layout, rc, lora=cfg)
    base_params = [p for p in base.parameters() if p.requires_grad]
    lora_params = [p for _, p in adapter_factors(lora)]
    opt_b = torch.optim.AdamW(base_params, lr=1e-5)
    opt_l = torch.optim.AdamW(lora_params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (a.batch * max(1, dist.get_world_size() // (layout.tp * layout.pp)),
                                                a.seq), generator=g)
    # data-parallel ranks would need a global batch that divides; use DP = world / (tp*pp)
    tb, tl, fb, fl = [], [], [], []
    for i in range(a.steps + 1):                         # step 0 is warm-up
        b = _step(base, base_params, opt_b, tokens, arch.vocab_size, None)
        l_ = _step(lora, lora_params, opt_l, tokens, arch.vocab_size, lambda: sync_adapter_grads(lora))
        t0 = time.perf_counter(); forward_logits(base, tokens[: a.batch], arch.vocab_size); f_b = time.perf_counter() - t0
        t0 = time.perf_counter(); forward_logits(lora, tokens[: a.batch], arch.vocab_size); f_l = time.perf_counter() - t0
        if i:
            tb.append(b), tl.append(l_), fb.append(f_b), fl.append(f_l)
    res = {
        "base_step_s": statistics.median(tb), "lora_step_s": statistics.median(tl),
        "base_fwd_s": statistics.median(fb), "lora_fwd_s": statistics.median(fl),
        "adapter_params_local": sum(p.numel() for p in lora_params),
        "base_params_local": sum(p.numel() for p in base.parameters()),
    }
    res["step_time_ratio"] = res["lora_step_s"] / res["base_step_s"]
    res["fwd_time_ratio"] = res["lora_fwd_s"] / res["base_fwd_s"]
    if dist.get_rank() == 0:
        with open(a.result, "w") as f:
            json.dump(res, f)
    teardown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
