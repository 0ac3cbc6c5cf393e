"""PEFT -> canonical adapter factors (refit/import_peft.py) is the exact inverse of the export (refit/rename.py):
fused q/k/v and gate/up B factors re-interleaved, expert and shared factors, per family; a missing, misshaped,
unclaimed or inconsistent PEFT tensor is a ValueError naming it."""
import pytest
import torch

from moe_lora_rl.models import FAMILIES, get_model
from moe_lora_rl.models.arch import load_arch
from moe_lora_rl.models.naming import naming_for
from moe_lora_rl.refit.import_peft import from_peft_tensors
from moe_lora_rl.refit.rename import to_peft_tensors


def _adapters(arch, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    H, I, hd = arch.hidden_size, arch.moe_ffn_hidden_size, arch.head_dim
    gated = 2 if getattr(arch, "attention_output_gate", False) else 1          # the hybrid's q_proj: query and gate
    qkv_rows = (gated * arch.num_heads + 2 * arch.num_kv_heads) * hd
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    out = {"layers.1.self_attention.linear_proj.lora_A": rnd(r, arch.num_heads * hd),
           "layers.1.self_attention.linear_proj.lora_B": rnd(H, r)}
    if not arch.mla:
        out.update({"layers.1.self_attention.linear_qkv.lora_A": rnd(r, H),
                    "layers.1.self_attention.linear_qkv.lora_B": rnd(qkv_rows, r)})
        if arch.layer_types:               # the hybrid's delta-net in_proj (B per key head) and out_proj
            from moe_lora_rl.lora.layers import delta_net_blocks

            blocks = delta_net_blocks(arch.linear_key_head_dim, arch.linear_value_head_dim,
                                      arch.linear_num_key_heads, arch.linear_num_value_heads)
            v = arch.linear_num_value_heads * arch.linear_value_head_dim
            out.update({"layers.1.self_attention.in_proj.lora_A": rnd(r, H),
                        "layers.1.self_attention.in_proj.lora_B": rnd(arch.linear_num_key_heads, sum(blocks), r),
                        "layers.1.self_attention.out_proj.lora_A": rnd(r, v),
                        "layers.1.self_attention.out_proj.lora_B": rnd(H, r)})
    else:                                  # every MLA linear (single-part: A and B are the PEFT tensors as they are)
        naming = naming_for(arch)
        shapes = naming.hf_shapes(arch, 1)
        for li in naming.layer_linears(arch, 1):
            if li.part == "attention" and li.target != "proj":
                i, o = shapes[li.hf[0]]
                out[f"layers.1.{li.megatron}.lora_A"], out[f"layers.1.{li.megatron}.lora_B"] = rnd(r, i), rnd(o, r)
    for e in range(arch.num_experts):
        out[f"layers.1.mlp.experts.{e}.linear_fc1.lora_A"] = rnd(r, H)
        out[f"layers.1.mlp.experts.{e}.linear_fc1.lora_B"] = rnd(2, I, r)
        out[f"layers.1.mlp.experts.{e}.linear_fc2.lora_A"] = rnd(r, I)
        out[f"layers.1.mlp.experts.{e}.linear_fc2.lora_B"] = rnd(H, r)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_inverts_export(family):
    arch = load_arch(str(get_model(family)))
    canon = _adapters(arch)
    peft = to_peft_tensors(canon, arch)
    back = from_peft_tensors(peft, arch, {k: tuple(v.shape) for k, v in canon.items()})
    assert back.keys() == canon.keys()
    for k, v in canon.items():
        assert torch.equal(back[k], v), k
    # a factor shared by all experts (shared_outer layout): every expert's PEFT copy must agree
    shared = {"layers.1.mlp.experts.linear_fc1.lora_A": canon["layers.1.mlp.experts.0.linear_fc1.lora_A"],
              **{k: v for k, v in canon.items() if "linear_fc1.lora_B" in k}}
    peft_s = to_peft_tensors(shared, arch)
    got = from_peft_tensors(peft_s, arch, {k: tuple(v.shape) for k, v in shared.items()})
    assert all(torch.equal(got[k], v) for k, v in shared.items())
    P = "base_model.model.model.layers.1."
    bad = dict(peft_s)
    bad[P + "mlp.experts.1.gate_proj.lora_A.weight"] = bad[P + "mlp.experts.1.gate_proj.lora_A.weight"] + 1e-3
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.lora_A\.weight differs from the other copies"):
        from_peft_tensors(bad, arch, {k: tuple(v.shape) for k, v in shared.items()})


def test_import_refuses_bad_tensors():
    arch = load_arch(str(get_model("qwen3_moe")))
    canon = _adapters(arch)
    shapes = {k: tuple(v.shape) for k, v in canon.items()}
    peft = to_peft_tensors(canon, arch)
    P = "base_model.model.model.layers.1."
    missing = {k: v for k, v in peft.items() if k != P + "self_attn.k_proj.lora_B.weight"}
    with pytest.raises(ValueError, match=r"k_proj\.lora_B\.weight \(of adapter factor .*linear_qkv.lora_B\) is miss"):
        from_peft_tensors(missing, arch, shapes)
    wrong = {**peft, P + "mlp.experts.0.down_proj.lora_A.weight": torch.zeros(2, arch.moe_ffn_hidden_size)}
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.lora_A\.weight has shape"):
        from_peft_tensors(wrong, arch, shapes)
    experts_only = {k: v for k, v in shapes.items() if "experts" in k}
    with pytest.raises(ValueError, match="have no adapter factor in the model"):
        from_peft_tensors(peft, arch, experts_only)
    # q/k/v of two different A copies cannot be one fused factor
    split_a = {**peft, P + "self_attn.v_proj.lora_A.weight": peft[P + "self_attn.v_proj.lora_A.weight"] * 2}
    with pytest.raises(ValueError, match=r"v_proj\.lora_A\.weight differs"):
        from_peft_tensors(split_a, arch, shapes)
