"""torchrun worker: training steps (fwd + bwd + grad sync + AdamW) of full fine-tuning ("base") vs LoRA, one model
and layout, batch `--batch` per data-parallel rank.

    --measure speed    both variants in this process, interleaved so both see the same machine state (step 0 is
                       warm-up): median step and forward seconds
    --measure memory --variant base|lora    one variant per fresh process, so neither's allocations hide the
                       other's; the kernel's resident-set high-water mark (getrusage ru_maxrss), not our counters:
        baseline   RSS after imports and process groups, before the model exists
        build + load (+ adapters) + optimizer; the HF checkpoint reader is closed
        reset the high-water mark (/proc/self/clear_refs "5": it then equals the current RSS)
        `steps` training steps (the first allocates grads and optimizer state)
        peak_mb = ru_maxrss - baseline: model state + grads + optimizer state + activations at their peak
        step_mb = ru_maxrss - RSS before the first step
        saved_mb = activations held for backward at the end of the last step's forward (torch's saved-tensor
                   hooks: unique storages, parameters excluded, sizes read when backward starts)
    --transformer-overrides JSON: verl's override_transformer_config (activation recompute), through
                       megatron.transformer_options
Reported as the maximum over ranks (memory) or rank 0's (speed)."""
from __future__ import annotations

import functools
import gc
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from ...checks.torchrun import finish_worker, worker_args
from ...lora import LoRAConfig, adapter_factors, sync_adapter_grads
from ...megatron.forward import forward_logits
from ...megatron.layout import Layout
from ...megatron.parallel import init_distributed, teardown
from ...megatron.train_step import lm_train_step
from ...megatron.transformer_options import transformer_options
from ...policy.model import build_from_hf


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


def reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class SavedActivations:
    """Bytes of the tensors autograd keeps for backward, counted when backward first unpacks one: every storage
    packed in the forward (views counted once; model parameters excluded), at its size then (megatron's
    CheckpointWithoutOutput frees some outputs after the forward). The storages are held until then, as autograd
    holds them; under PP this delays megatron's deallocation of a stage's output, so read step_mb at pp1."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.bytes = 0

    def pack(self, t):
        if self.storages is not None and not _in_backward():
            st = t.untyped_storage()
            if st.data_ptr() not in self.params:           # keyed by the storage itself: a freed output's address
                self.storages.setdefault(st._cdata, st)    # can be reused by a later one while we hold both
        return t

    def unpack(self, t):
        if self.storages is not None:              # the first unpack: the forward is over
            self.bytes = sum(st.nbytes() for st in self.storages.values())
            self.storages = None
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def build(a, layout: Layout, lora: LoRAConfig | None):
    """(arch, model, trainable params, grad sync after backward) of one variant."""
    arch, model = build_from_hf(a.model, layout, a.rc, lora=lora,
                                transformer_overrides=transformer_options(json.loads(a.transformer_overrides)))
    if lora is None:
        return arch, model, [p for p in model.parameters() if p.requires_grad], None
    return arch, model, [p for _, p in adapter_factors(model)], functools.partial(sync_adapter_grads, model)


def batch(a, arch, dp: int) -> torch.Tensor:
    return torch.randint(0, arch.vocab_size, (a.batch * dp, a.seq), generator=torch.Generator().manual_seed(0))


def step(model, params, opt, tokens, vocab, sync) -> float:
    t0 = time.perf_counter()
    for p in params:
        p.grad = None
    lm_train_step(model, tokens, vocab, micro_batch_size=tokens.shape[0], after_backward=sync)
    opt.step()
    return time.perf_counter() - t0


def speed(a, layout: Layout, cfg: LoRAConfig, dp: int) -> dict:
    arch, base, base_params, _ = build(a, layout, None)
    _, lora, lora_params, sync = build(a, layout, cfg)
    opt_b, opt_l = torch.optim.AdamW(base_params, lr=1e-5), torch.optim.AdamW(lora_params, lr=1e-4)
    tokens = batch(a, arch, dp)
    tb, tl, fb, fl = [], [], [], []
    for i in range(a.steps + 1):                         # step 0 is warm-up
        b = step(base, base_params, opt_b, tokens, arch.vocab_size, None)
        l_ = step(lora, lora_params, opt_l, tokens, arch.vocab_size, sync)
        t0 = time.perf_counter(); forward_logits(base, tokens[: a.batch], arch.vocab_size); f_b = time.perf_counter() - t0
        t0 = time.perf_counter(); forward_logits(lora, tokens[: a.batch], arch.vocab_size); f_l = time.perf_counter() - t0
        if i:
            tb.append(b), tl.append(l_), fb.append(f_b), fl.append(f_l)
    res = {"base_step_s": statistics.median(tb), "lora_step_s": statistics.median(tl),
           "base_fwd_s": statistics.median(fb), "lora_fwd_s": statistics.median(fl),
           "adapter_params_local": sum(p.numel() for p in lora_params),
           "base_params_local": sum(p.numel() for p in base.parameters())}
    res["step_time_ratio"] = res["lora_step_s"] / res["base_step_s"]
    res["fwd_time_ratio"] = res["lora_fwd_s"] / res["base_fwd_s"]
    return res


def memory(a, layout: Layout, cfg: LoRAConfig, dp: int) -> dict:
    gc.collect()
    baseline = rss_kb()
    arch, model, params, sync = build(a, layout, cfg if a.variant == "lora" else None)
    opt = torch.optim.AdamW(params, lr=1e-5)
    tokens = batch(a, arch, dp)
    gc.collect()
    before_step = rss_kb()
    reset = reset_high_water()
    for _ in range(a.steps - 1):
        step(model, params, opt, tokens, arch.vocab_size, sync)
    saved = SavedActivations(model)
    with saved.hooks():
        last_s = step(model, params, opt, tokens, arch.vocab_size, sync)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # KiB on Linux
    vals = torch.tensor([peak - baseline, peak - before_step, before_step - baseline, saved.bytes / 1024],
                        dtype=torch.float64) / 1024
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    return {"peak_mb": vals[0].item(), "step_mb": vals[1].item(), "state_mb": vals[2].item(),
            "saved_mb": vals[3].item(), "last_step_s": last_s, "hwm_reset": reset,
            "trainable_params": sum(p.numel() for p in params), "variant": a.variant}


def main(argv=None):
    def add(ap):
        ap.add_argument("--model", required=True)
        ap.add_argument("--layout", default="tp1ep1pp1")
        ap.add_argument("--measure", choices=("speed", "memory"), required=True)
        ap.add_argument("--variant", choices=("base", "lora"), help="--measure memory: the one variant measured")
        ap.add_argument("--steps", type=int, default=None, help="default: 4 (speed), 2 (memory)")
        ap.add_argument("--batch", type=int, default=2)
        ap.add_argument("--seq", type=int, default=128)
        ap.add_argument("--transformer-overrides", default="{}", help="verl's override_transformer_config as JSON")

    a = worker_args(argv, add, lora=True)
    a.steps = a.steps or (4 if a.measure == "speed" else 2)
    layout = Layout.parse(a.layout)
    init_distributed(layout, a.rc)
    dp = max(1, dist.get_world_size() // (layout.tp * layout.pp))      # the global batch splits over DP ranks
    res = speed(a, layout, a.lora, dp) if a.measure == "speed" else memory(a, layout, a.lora, dp)
    teardown()
    finish_worker(res, a.result)


if __name__ == "__main__":
    main()
