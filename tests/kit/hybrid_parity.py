"""Megatron = HF for the hybrid linear-attention family (torchrun worker of tests/distributed/test_hybrid_parity.py).

    python -m kit.hybrid_parity --cases '{"tp1ep1pp1": [DIR, ...], "tp2": [DIR]}' --controls DIR --workdir W --result R

Per layout and model: the megatron-core model built and loaded from the HF checkpoint (fp32, CPU) against
transformers' fp32 logits on the same tokens (HF's torch delta-rule and conv paths, its own routing): max |diff|,
max |ref|, the local delta-net value heads of the first linear layer (TP splits them), and HF's own fp32 conditioning
(hf_ulp: the largest move of HF's logits when its input embeddings are perturbed by half an ulp, two draws).
Negative controls on the --controls model at the first layout, each measured the same way:
    gate_rows_zeroed   the gated attention's gate rows of linear_qkv zeroed (sigmoid(0) = 1/2 instead of HF's gate)
    conv_reversed      every delta-net conv1d kernel reversed along its width
    pattern_rolled     a copy of the checkpoint with layer_types and the layers rolled by one (layer i holds HF layer
                       i-1 and its type), built and loaded as any checkpoint; and the original checkpoint with only
                       the pattern rolled, which the loader must refuse (pattern_rolled_refused: its message)
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist


def rolled_checkpoint(src: str, dst: Path) -> Path:
    """A copy of the HF checkpoint at src whose layers are rolled by one: layer (L + 1) % n holds layer L's tensors,
    and layer_types is rolled alike (text models only: config.json with layer_types at the top)."""
    from safetensors.torch import save_file

    from moe_lora_rl.models.checkpoint import HFCheckpoint

    conf = json.loads(Path(src, "config.json").read_text())
    n, types = conf["num_hidden_layers"], conf["layer_types"]
    conf["layer_types"] = types[-1:] + types[:-1]
    ckpt, out = HFCheckpoint(src), {}
    for name in ckpt.weight_map:
        parts = name.split(".")
        if name.startswith("model.layers."):
            parts[2] = str((int(parts[2]) + 1) % n)
        out[".".join(parts)] = ckpt.get(name).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst


@torch.no_grad()
def hf_ulp_sensitivity(path: str, tokens: torch.Tensor, ref: torch.Tensor, draws: int = 2) -> float:
    """max |HF logits - ref| when HF's input embeddings are scaled by 1 +- 2^-24 at random (half an ulp)."""
    from moe_lora_rl.checks.hf import hf_model

    hf = hf_model(path)
    emb = hf.get_input_embeddings()(tokens)
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for _ in range(draws):
        sign = torch.randint(0, 2, emb.shape, generator=gen).to(emb.dtype) * 2 - 1
        got = hf(inputs_embeds=emb * (1 + sign * 2.0 ** -24)).logits.float()
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def _gate_rows(model) -> list[torch.Tensor]:
    """The gate rows of each full-attention layer's local linear_qkv (per query group [q heads, gate heads, k, v])."""
    out = []
    for layer in model.decoder.layers:
        att = layer.self_attention
        if not hasattr(att, "linear_qkv"):
            continue
        w = att.linear_qkv.weight
        groups, hd = att.num_query_groups_per_partition, att.hidden_size_per_attention_head
        qpg = att.num_attention_heads_per_partition // groups
        out.append(w.view(groups, (2 * qpg + 2) * hd, -1)[:, qpg * hd: 2 * qpg * hd])
    return out


def _measure(model, arch, tokens, ref) -> dict:
    from moe_lora_rl.megatron.forward import forward_logits

    got = forward_logits(model, tokens, arch.vocab_size)
    if got is None:
        return {"max_abs": -1.0}
    return {"max_abs": float((got - ref).abs().max())}


def _controls(path: str, layout, rc, tokens, ref, workdir: Path) -> dict:
    from moe_lora_rl.megatron.build import build_model
    from moe_lora_rl.megatron.hf_load import load_hf_weights
    from moe_lora_rl.policy.model import build_from_hf

    arch, model = build_from_hf(path, layout, rc)
    out = {}
    with torch.no_grad():
        gates = _gate_rows(model)
        assert gates, "no full-attention layer on this stage to drop the gate of"
        saved = [g.clone() for g in gates]
        for g in gates:
            g.zero_()
        out["gate_rows_zeroed"] = _measure(model, arch, tokens, ref)["max_abs"]
        for g, s in zip(gates, saved):
            g.copy_(s)
        convs = [layer.self_attention.conv1d.weight for layer in model.decoder.layers
                 if hasattr(layer.self_attention, "conv1d")]
        for w in convs:
            w.copy_(w.flip(-1))
        out["conv_reversed"] = _measure(model, arch, tokens, ref)["max_abs"]
    del model
    rolled = workdir / "rolled"
    if dist.get_rank() == 0:
        rolled_checkpoint(path, rolled)
    dist.barrier()
    r_arch, model = build_from_hf(str(rolled), layout, rc)
    assert r_arch.layer_types != arch.layer_types
    out["pattern_rolled"] = _measure(model, r_arch, tokens, ref)["max_abs"]
    del model
    model = build_model(dataclasses.replace(arch, layer_types=r_arch.layer_types), layout, rc)
    try:
        load_hf_weights(model, path, arch)
        out["pattern_rolled_refused"] = ""
    except ValueError as e:
        out["pattern_rolled_refused"] = str(e)
    return out


def main(argv=None):
    from moe_lora_rl.checks.hf import hf_logits
    from moe_lora_rl.checks.torchrun import each_layout, finish_worker, worker_args
    from moe_lora_rl.checks.parity_run import sample_tokens
    from moe_lora_rl.policy.model import build_from_hf

    def add(ap):
        ap.add_argument("--cases", required=True, help="JSON {layout: [HF checkpoint dirs]}")
        ap.add_argument("--controls", default="", help="checkpoint whose negative controls run at the first layout")
        ap.add_argument("--workdir", required=True)

    a = worker_args(argv, add)
    cases = json.loads(a.cases)
    torch.manual_seed(0)
    out: dict = {"parity": {}, "controls": {}}
    ulp: dict[str, float] = {}                       # HF's sensitivity per model, once (it is layout-free)
    for key, layout in each_layout(",".join(cases), a.rc):
        for path in cases[key]:
            arch, model = build_from_hf(path, layout, a.rc)
            tokens = sample_tokens(arch.vocab_size)
            ref = hf_logits(path, tokens)
            rec = _measure(model, arch, tokens, ref)
            rec["delta_heads_local"] = max([getattr(layer.self_attention, "num_v_heads_local_tp", -1)
                                            for layer in model.decoder.layers])
            del model
            rec["ref_max_abs"] = float(ref.abs().max())
            if path not in ulp:
                ulp[path] = hf_ulp_sensitivity(path, tokens, ref)
            rec["hf_ulp"] = ulp[path]
            vals = torch.tensor([rec[k] for k in sorted(rec)])
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            out["parity"].setdefault(key, {})[path] = dict(zip(sorted(rec), vals.tolist()))
            if path == a.controls and key == next(iter(cases)):
                c = _controls(path, layout, a.rc, tokens, ref, Path(a.workdir))
                refused = c.pop("pattern_rolled_refused")
                vals = torch.tensor([c[k] for k in sorted(c)])
                dist.all_reduce(vals, op=dist.ReduceOp.MAX)
                out["controls"] = {**dict(zip(sorted(c), vals.tolist())), "pattern_rolled_refused": refused}
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
