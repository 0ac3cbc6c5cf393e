"""torchrun worker: LoRA on a Megatron model at each layout; equal-at-init, K training steps, gathered adapters,
sharded checkpoint save and cross-layout load; with --peft the trained adapter exported as the main job exports it
(refit/export.stream_to_peft, --out/peft-LAYOUT-mI). Rank 0 writes tensors to --out and a JSON summary to --result."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..lora import LoRAConfig, adapter_factors, apply_lora, gather_adapters, load_sharded, save_sharded
from ..lora import sync_adapter_grads
from ..megatron.forward import forward_logits
from ..megatron.layout import Layout
from ..megatron.run_config import RunConfig
from ..megatron.train_step import lm_train_step
from ..policy.model import build_from_hf
from .torchrun import each_model_at_layout, finish_worker, worker_args


def build(path: str, layout: Layout, cfg: LoRAConfig | None, grouped: bool = False, rc: RunConfig | None = None):
    return build_from_hf(path, layout, rc, lora=cfg, grouped_experts=grouped)


def train(model, arch, tokens: torch.Tensor, steps: int, lr: float, mbs: int,
          first_grads: dict | None = None) -> tuple[list[float], list[float]]:
    """first_grads: filled with the first step's adapter gradients, gathered to canonical names (every layout starts
    from the same adapters, so these are comparable across layouts before any update)."""
    params = [p for _, p in adapter_factors(model)] if hasattr(model, "lora_config") else \
        [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        loss = lm_train_step(model, tokens, arch.vocab_size, micro_batch_size=mbs,
                             after_backward=lambda: sync_adapter_grads(model) if hasattr(model, "lora_config") else None)
        if first_grads is not None and not losses:
            first_grads.update(gather_adapters(model, check_replicas=False, grads=True))   # adapters are checked
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return losses, times


def run_one(a, cfg, layout, key, mi, path, data, out: Path) -> dict:
    arch, model = build(path, layout, None, a.grouped, a.rc)
    base_logits = forward_logits(model, data["eval"], arch.vocab_size)
    apply_lora(model, cfg)
    lora_logits = forward_logits(model, data["eval"], arch.vocab_size)
    init_diff = torch.tensor(-1.0 if base_logits is None else (lora_logits - base_logits).abs().max().item())
    dist.all_reduce(init_diff, op=dist.ReduceOp.MAX)
    trainable = [p for p in model.parameters() if p.requires_grad]
    only_adapters = torch.tensor(int(bool(trainable) and all(hasattr(p, "lora_meta") for p in trainable)))
    dist.all_reduce(only_adapters, op=dist.ReduceOp.MIN)
    grads: dict = {}
    losses, times = train(model, arch, data["train"], a.steps, a.lr, a.mbs, grads)
    adapters = gather_adapters(model)
    blocked = [p.shape[0] // sum(p.lora_meta.blocks) for _, p in adapter_factors(model) if p.lora_meta.blocks]
    eval_logits = forward_logits(model, data["eval"], arch.vocab_size)
    save_sharded(model, out / f"ckpt-{key}-m{mi}")
    if a.peft:
        from ..refit.export import stream_to_peft

        stream_to_peft(model, arch, out / f"peft-{key}-m{mi}", base_model=path)
    rec = {"init_diff": float(init_diff), "only_adapters_trainable": bool(only_adapters), "losses": losses,
           "n_adapter_tensors": len(adapters), "adapter_params": sum(t.numel() for t in adapters.values()),
           "step_s": times, "blocked_heads_local": max(blocked, default=0)}
    blob = {"adapters": adapters, "grads": grads, "eval_logits": eval_logits, "base_logits": base_logits,
            "losses": losses}
    if a.load_from:
        _, fresh = build(path, layout, cfg, a.grouped, a.rc)
        load_sharded(fresh, out / f"ckpt-{a.load_from}-m{mi}")
        blob["loaded_adapters"] = gather_adapters(fresh)
        blob["loaded_logits"] = forward_logits(fresh, data["eval"], arch.vocab_size)
        if a.controls:
            blob["control_logits"] = control_logits(fresh, arch, cfg, data["eval"])
        del fresh
    if dist.get_rank() == dist.get_world_size() - 1:     # always on the last pipeline stage: it holds the logits
        torch.save(blob, out / f"{key}-m{mi}.pt")
    del model
    return rec


def control_logits(model, arch, cfg: LoRAConfig, tokens: torch.Tensor) -> dict:
    """Negative controls on a model holding the reference's adapters: logits with one target's adapters dropped
    (scale 0 on every module of that target), for each target the model has, with one factor perturbed (the
    first factor of the first target, + 1e-2 on every element), and, where a B factor's rows are reordered to its
    base's (the delta-net's in_proj), with them applied unreordered ("rows:TARGET"). Each must differ from the
    reference's logits."""
    targets = [t for t in cfg.resolved_targets() if t in arch.adaptable()]       # the same list on every rank
    adapters = [m.lora for m in model.modules() if hasattr(m, "lora") and hasattr(m.lora, "factor_A")]
    out = {}
    for t in targets:
        dropped = [ad for ad in adapters if ad.factor_A.lora_meta.target == t]
        for ad in dropped:
            ad.scale, ad._kept_scale = 0.0, ad.scale
        out[f"drop:{t}"] = forward_logits(model, tokens, arch.vocab_size)
        for ad in dropped:
            ad.scale = ad._kept_scale
        reordered = [ad for ad in dropped if getattr(ad, "row_order", None) is not None     # where it moves rows
                     and not torch.equal(ad.row_order, torch.arange(len(ad.row_order), device=ad.row_order.device))]
        anywhere = torch.tensor(len(reordered))
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)              # the same branch on every stage
        if anywhere.item():
            for ad in reordered:
                ad.row_order, ad._kept_order = None, ad.row_order
            out[f"rows:{t}"] = forward_logits(model, tokens, arch.vocab_size)
            for ad in reordered:
                ad.row_order = ad._kept_order
    factors = [p for _, p in adapter_factors(model) if p.lora_meta.target == targets[0]]
    with torch.no_grad():
        for p in factors[:1]:
            p.add_(1e-2)
        out[f"perturb:{targets[0]}"] = forward_logits(model, tokens, arch.vocab_size)
        for p in factors[:1]:
            p.sub_(1e-2)
    return out


def main(argv=None):
    def add(ap):
        ap.add_argument("--data", required=True, help=".pt: {model_dir: {'train': [N,S], 'eval': [B,S]}} token tensors")
        ap.add_argument("--steps", type=int, default=3)
        ap.add_argument("--lr", type=float, default=1e-4)
        ap.add_argument("--mbs", type=int, default=1)
        ap.add_argument("--out", required=True)
        ap.add_argument("--load-from", default=None, help="layout whose checkpoints (in --out) to load and compare")
        ap.add_argument("--grouped", action="store_true", help="legacy GroupedMLP experts (megatron-core 0.16)")
        ap.add_argument("--peft", action="store_true", help="export each trained adapter with stream_to_peft")
        ap.add_argument("--controls", action="store_true", help="with --load-from: negative controls (a target's "
                        "adapters dropped, one factor perturbed) on the loaded adapters")

    a = worker_args(argv, add, models_at_layouts=True, lora=True)
    data = torch.load(a.data)
    summary: dict = {}
    for key, layout, mi, path in each_model_at_layout(a):
        summary.setdefault(key, {})[path] = run_one(a, a.lora, layout, key, mi, path, data[path], Path(a.out))
    finish_worker(summary, a.result)

if __name__ == "__main__":
    main()
