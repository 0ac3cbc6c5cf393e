"""torchrun worker: one forward + backward of LoRA (every target, non-zero B) per variant (a layout plus megatron-core
MoE options, given as a user's override_transformer_config), its eval logits and every adapter factor's gradient
(synced, gathered to canonical tensors) saved to --out/VARIANT-mI.pt for moe_options.compare.

A variant may name negative controls, each stepped on the same model after the variant's own step (saved as
VARIANT+CONTROL-mI.pt), that break the adapter path as other stacks broke it under ETP / shared-expert overlap:
"double:TARGET" (that target's delta counted twice on the second rank of its tensor-parallel group, i.e. added once
per rank), "detach:TARGET" (its delta cut from autograd: outputs unchanged, no gradient).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lora_rl.lora import LoRAConfig, adapter_factors, gather_adapters, sync_adapter_grads
from moe_lora_rl.lora.apply import group_coords
from moe_lora_rl.lora.layers import make_factor
from moe_lora_rl.megatron.forward import forward_logits
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.megatron.moe_options import transformer_overrides
from moe_lora_rl.megatron.parallel import init_distributed, teardown
from moe_lora_rl.megatron.train_step import lm_train_step
from moe_lora_rl.policy.model import build_from_hf
from moe_lora_rl.checks.torchrun import finish_worker, worker_args

B_INIT_SEED = 1            # B drawn like A (seeded per global name, layout-independent) so that A's gradient is not 0
B_SCALE = 0.1


def nonzero_b(model, seed: int = B_INIT_SEED) -> None:
    """Every B factor set to a seeded draw (the same global tensor at every layout), scaled by B_SCALE."""
    ranks, sizes = group_coords()
    with torch.no_grad():
        for name, p in adapter_factors(model):
            meta = p.lora_meta
            if meta.global_name.endswith("lora_B"):
                full = make_factor(meta, ranks[meta.group], sizes[meta.group], init="kaiming", seed=seed,
                                   dtype=p.dtype, device=p.device)
                p.copy_(full * B_SCALE)


def apply_control(model, control: str):
    """Break the adapters of one target as `control` says (module docstring); returns (how many adapters this rank
    broke, a function that undoes it)."""
    kind, target = control.split(":")
    if kind not in ("double", "detach"):
        raise ValueError(f"control {control!r}: choose double:TARGET or detach:TARGET")
    ranks, _ = group_coords()
    broken = []
    for mod in model.modules():
        ad = getattr(mod, "lora", None)
        if ad is None or not hasattr(ad, "factor_A") or ad.factor_A.lora_meta.target != target:
            continue
        if kind == "double" and ranks["etp" if ad.rule.expert else "tp"] == 1:
            ad.scale *= 2.0
            broken.append(ad)
        elif kind == "detach":
            ad.forward = lambda x, f=ad.forward: f(x).detach()
            broken.append(ad)

    def undo():
        for ad in broken:
            if kind == "double":
                ad.scale /= 2.0
            else:
                del ad.forward
    return len(broken), undo


def step(a, model, arch, data: dict, name: str, out: Path) -> dict:
    """One forward + backward with synced adapter gradients, then the eval logits; saved to out/NAME.pt."""
    for _, p in adapter_factors(model):
        p.grad = None
    loss = lm_train_step(model, data["train"], arch.vocab_size, micro_batch_size=a.mbs,
                         after_backward=lambda: sync_adapter_grads(model))
    grads = gather_adapters(model, grads=True)
    logits = forward_logits(model, data["eval"], arch.vocab_size)
    if dist.get_rank() == dist.get_world_size() - 1:     # the last pipeline stage holds the logits
        torch.save({"logits": logits, "grads": grads}, out / f"{name}.pt")
    return {"loss": loss}


def run_variant(a, v: dict, mi: int, path: str, data: dict, out: Path) -> dict:
    """The variant's step, then each of its controls' on the same model (broken, stepped, restored)."""
    t0 = time.perf_counter()
    layout = Layout.parse(v["layout"])
    kw = transformer_overrides(v.get("overrides", {}), layout, a.rc)
    arch, model = build_from_hf(path, layout, a.rc, lora=a.lora, **kw)
    nonzero_b(model)
    recs = {v["name"]: step(a, model, arch, data, f"{v['name']}-m{mi}", out)}
    recs[v["name"]]["s"] = time.perf_counter() - t0
    for control in v.get("controls", ()):
        n, undo = apply_control(model, control)
        broken = torch.tensor(n)
        dist.all_reduce(broken)
        name = f"{v['name']}+{control}"
        recs[name] = {**step(a, model, arch, data, f"{name}-m{mi}", out), "broken_adapters": int(broken)}
        undo()
    del model
    return recs


def main(argv=None):
    def add(ap):
        ap.add_argument("--models", required=True, help="comma-separated HF checkpoint dirs")
        ap.add_argument("--variants", required=True, help="JSON list of {name, layout, overrides, controls}")
        ap.add_argument("--data", required=True, help=".pt: {model_dir: {'train': [N,S], 'eval': [B,S]}}")
        ap.add_argument("--mbs", type=int, default=1)
        ap.add_argument("--out", required=True)

    a = worker_args(argv, add, lora=True)
    data, out = torch.load(a.data), Path(a.out)
    summary: dict = {}
    for v in json.loads(a.variants):
        init_distributed(Layout.parse(v["layout"]), a.rc)
        for mi, path in enumerate(a.models.split(",")):
            for name, rec in run_variant(a, v, mi, path, data[path], out).items():
                summary.setdefault(name, {})[path] = rec
        teardown()
    finish_worker(summary, a.result)


if __name__ == "__main__":
    main()
