"""torchrun worker (2 ranks): LoRA training checkpoints at two layouts (--model: a built-in FAMILY/SIZE, default
glm4_moe/tiny, or an HF checkpoint dir).

Train 2 AdamW steps at --save-layout, save, run step 3 (the uninterrupted reference); then, at every --load-layouts
layout, a fresh model loads the checkpoint: gathered adapters and Adam moments against the saved ones, then step 3
against the reference; negative control at each layout: loading without the optimizer state. Rank 0 reports maxima.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from moe_lora_rl.lora import LoRAConfig, adapter_factors, sync_adapter_grads
from moe_lora_rl.lora.grad_sync import process_group
from moe_lora_rl.policy.model import build_from_hf
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.parallel import init_distributed, teardown
from moe_lora_rl.megatron.train_step import lm_train_step
from moe_lora_rl.models import get_model
from moe_lora_rl.checkpoint.api import describe_run, load_checkpoint, rng_state, save_checkpoint
from moe_lora_rl.checks.torchrun import finish_worker, worker_args


@torch.no_grad()
def gather(model, optimizer=None, kind: str | None = None) -> dict[str, torch.Tensor]:
    """Global canonical tensors of every adapter factor (kind None) or of its optimizer state `kind`."""
    local = {}
    for _, p in adapter_factors(model):
        meta = p.lora_meta
        src = p if kind is None else optimizer.state[p][kind]
        t = meta.canonical(src.detach()).float().contiguous()
        if meta.shard_dim is not None:
            g = process_group(meta.group)
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(g))]
            dist.all_gather(parts, t, group=g)
            t = torch.cat(parts, dim=meta.shard_dim)
        local[meta.global_name] = t.clone()
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    return {k: v for part in everything for k, v in part.items()}


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def build(path, layout, rc, cfg, lr):
    init_distributed(layout, rc)
    arch, model = build_from_hf(path, layout, rc, lora=cfg)
    opt = torch.optim.AdamW([p for _, p in adapter_factors(model)], lr=lr, weight_decay=0.01)
    return arch, model, opt


def train_step(model, opt, arch, tokens) -> float:
    opt.zero_grad(set_to_none=True)
    loss = lm_train_step(model, tokens, arch.vocab_size, micro_batch_size=1,
                         after_backward=lambda: sync_adapter_grads(model))
    opt.step()
    return loss


def main(argv=None):
    def add(ap):
        ap.add_argument("--save-layout", default="tp2ep2")
        ap.add_argument("--load-layouts", default="tp2ep2,tp1ep1pp1")
        ap.add_argument("--out", required=True)
        ap.add_argument("--lr", type=float, default=1e-4)
        ap.add_argument("--model", default="glm4_moe/tiny", help="a built-in FAMILY/SIZE or an HF checkpoint dir")

    a = worker_args(argv, add)                                   # fp32 on CPU
    rc = a.rc
    path = get_model(*a.model.split("/")) if a.model.count("/") == 1 and not Path(a.model).is_dir() else a.model
    cfg = LoRAConfig(rank=4, alpha=8.0)
    root = Path(a.out) / "ckpt"

    save_layout = Layout.parse(a.save_layout)
    arch, model, opt = build(path, save_layout, rc, cfg, a.lr)
    rank = dist.get_rank()
    tokens = torch.randint(0, arch.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = [train_step(model, opt, arch, tokens) for _ in range(2)]
    save_checkpoint(root, 2, model, opt, run_meta=describe_run(path, cfg, save_layout),
                    state={"step": 2, "rank": rank, "rng": rng_state()})
    saved = {k: gather(model, opt, k) for k in (None, "exp_avg", "exp_avg_sq")}
    saved_steps = {float(s["step"]) for s in opt.state.values()}
    ref_loss3 = train_step(model, opt, arch, tokens)
    ref_after3 = gather(model)
    ref_loss4 = train_step(model, opt, arch, tokens)
    del model, opt
    teardown()

    result = {"losses": losses, "saved_steps": sorted(saved_steps), "per_layout": {}}
    for name in a.load_layouts.split(","):
        layout = Layout.parse(name)
        arch, model, opt = build(path, layout, rc, cfg, 1.0)      # lr comes back from the checkpoint
        state = load_checkpoint(root, model, opt, run_meta=describe_run(path, cfg, layout))
        rec = {"state_step": state["step"], "state_rank_ok": state["rank"] == rank,
               "lr": opt.param_groups[0]["lr"], "steps": sorted({float(s["step"]) for s in opt.state.values()})}
        for k, want in saved.items():
            rec[f"{k or 'adapter'}_diff"] = max_diff(gather(model, opt, k), want)
        rec["loss3_diff"] = abs(train_step(model, opt, arch, tokens) - ref_loss3)
        rec["after3_diff"] = max_diff(gather(model), ref_after3)
        rec["loss4_diff"] = abs(train_step(model, opt, arch, tokens) - ref_loss4)
        del model, opt
        # negative control: the same checkpoint without the optimizer state
        arch, model, opt = build(path, layout, rc, cfg, a.lr)
        load_checkpoint(root, model, None, run_meta=describe_run(path, cfg, layout))
        rec["no_opt_adapter_diff"] = max_diff(gather(model), saved[None])
        train_step(model, opt, arch, tokens)
        rec["no_opt_after3_diff"] = max_diff(gather(model), ref_after3)
        rec["no_opt_loss4_diff"] = abs(train_step(model, opt, arch, tokens) - ref_loss4)
        del model, opt
        teardown()
        result["per_layout"][name] = rec
    finish_worker(result, a.result)


if __name__ == "__main__":
    main()
