"""torchrun worker: peak process memory of training steps of one variant (full fine-tuning or LoRA), measured by
the kernel's resident-set high-water mark (getrusage ru_maxrss), not by our own counters. One fresh process per
variant, so neither variant's allocations can hide the other's.

    baseline   RSS after imports and process groups, before the model exists
    build + load (+ adapters) + optimizer; the HF checkpoint reader is closed
    reset the high-water mark (/proc/self/clear_refs "5": it then equals the current RSS)
    `steps` training steps (fwd + bwd + grad sync + AdamW; the first allocates grads and optimizer state)
    peak_mb = ru_maxrss - baseline: model state + grads + optimizer state + activations at their peak
    step_mb = ru_maxrss - RSS before the first step
Reported per rank as the maximum over ranks.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import resource

import torch
import torch.distributed as dist

from ..lora import LoRAConfig, adapter_factors, sync_adapter_grads
from ..policy.model import build_from_hf
from ..megatron.layout import Layout
from ..megatron.parallel import init_distributed, teardown
from ..megatron.run_config import prepare_host
from ..megatron.train_step import lm_train_step
from ..checks.launch import finish_worker
from .run_args import from_worker_arg


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def max_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # KiB on Linux


def reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", default="tp1ep1pp1")
    ap.add_argument("--variant", choices=("base", "lora"), required=True)
    ap.add_argument("--lora", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--run-config", default="", help="RunConfig as JSON; default fp32 on CPU")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    rc = from_worker_arg(a.run_config)
    prepare_host(rc)
    layout = Layout.parse(a.layout)
    init_distributed(layout, rc)
    gc.collect()
    baseline = rss_kb()
    lora = LoRAConfig.from_dict(json.loads(a.lora)) if a.variant == "lora" else None
    arch, model = build_from_hf(a.model, layout, rc, lora=lora)
    if lora is not None:
        params, sync = [p for _, p in adapter_factors(model)], functools.partial(sync_adapter_grads, model)
    else:
        params, sync = [p for p in model.parameters() if p.requires_grad], None
    opt = torch.optim.AdamW(params, lr=1e-5)
    dp = max(1, dist.get_world_size() // (layout.tp * layout.pp))
    tokens = torch.randint(0, arch.vocab_size, (a.batch * dp, a.seq), generator=torch.Generator().manual_seed(0))
    gc.collect()
    before_step = rss_kb()
    reset = reset_high_water()
    for _ in range(a.steps):
        for p in params:
            p.grad = None
        lm_train_step(model, tokens, arch.vocab_size, micro_batch_size=tokens.shape[0], after_backward=sync)
        opt.step()
    peak = max_rss_kb()
    vals = torch.tensor([peak - baseline, peak - before_step, before_step - baseline], dtype=torch.float64) / 1024
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    res = {"peak_mb": vals[0].item(), "step_mb": vals[1].item(), "state_mb": vals[2].item(), "hwm_reset": reset,
           "trainable_params": sum(p.numel() for p in params), "variant": a.variant}
    del model, opt
    teardown()
    finish_worker(res, a.result)


if __name__ == "__main__":
    main()
