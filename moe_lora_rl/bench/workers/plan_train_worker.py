"""torchrun worker: LoRA training step times (fwd + bwd + adapter grad sync + AdamW on the adapters) of a
Megatron-core model at several global batch sizes, microbatch 1, interleaved; reports the median wall and
process-CPU seconds per batch."""
from __future__ import annotations

import statistics
import time

import torch

from ...checks.torchrun import finish_worker, worker_args
from ...lora import adapter_factors, sync_adapter_grads
from ...megatron.layout import Layout
from ...megatron.parallel import init_distributed, teardown
from ...megatron.train_step import lm_train_step
from ...policy.model import build_from_hf


def main(argv=None):
    def add(ap):
        ap.add_argument("--model", required=True)
        ap.add_argument("--batches", required=True, help="comma-separated global batch sizes")
        ap.add_argument("--seq", type=int, required=True)
        ap.add_argument("--repeats", type=int, default=3)

    a = worker_args(argv, add, lora=True)                               # fp32 on CPU
    layout = Layout()
    init_distributed(layout)
    arch, model = build_from_hf(a.model, layout, lora=a.lora)
    params = [p for _, p in adapter_factors(model)]
    opt = torch.optim.AdamW(params, lr=1e-4)
    batches = [int(b) for b in a.batches.split(",")]
    g = torch.Generator().manual_seed(0)
    data = {b: torch.randint(0, arch.vocab_size, (b, a.seq), generator=g) for b in batches}

    def step(b: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for p in params:
            p.grad = None
        lm_train_step(model, data[b], arch.vocab_size, micro_batch_size=1,
                      after_backward=lambda: sync_adapter_grads(model))
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    step(batches[0])                                             # warm-up
    times = {b: [] for b in batches}
    for _ in range(a.repeats):
        for b in batches:
            times[b].append(step(b))
    teardown()
    finish_worker({"wall_s": {str(b): statistics.median(t[0] for t in v) for b, v in times.items()},
                   "cpu_s": {str(b): statistics.median(t[1] for t in v) for b, v in times.items()}}, a.result)


if __name__ == "__main__":
    main()
