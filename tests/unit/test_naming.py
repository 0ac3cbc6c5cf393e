"""Every name of every family round-trips HF <-> Megatron <-> canonical <-> PEFT <-> vLLM and back, with global
layer numbers under PP and global expert ids under EP; hand-written examples pin the mapping itself (a consistent
but wrong table would pass the round trip, not these); unknown names are ValueErrors naming the tensor."""
import pytest
import torch

from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.checkpoint import HFCheckpoint
from moe_lora_rl.models.naming import FAMILIES, AdapterName, Offsets, VllmName, naming_for, owner
from moe_lora_rl.models.tiny import build_hf_config
from moe_lora_rl.refit.rename import peft_outputs, place, to_peft_tensors

ARCHS = {f: arch_from_hf_config(build_hf_config(f, "tiny")) for f in FAMILIES}
LAYOUTS = [(1, 1), (2, 2), (2, 4), (1, 8)]          # (pp, ep)


def _adapters(arch):
    naming = naming_for(arch)
    for layer in range(arch.num_layers):
        for li in naming.layer_linears(arch, layer):
            for e in (range(arch.num_experts) if li.part == "expert" else [None]):
                yield AdapterName(li, layer, e)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("pp,ep", LAYOUTS)
def test_adapter_names_round_trip(family, pp, ep):
    arch = ARCHS[family]
    naming = naming_for(arch)
    parts = set()
    for name in _adapters(arch):
        parts.add(name.linear.part)
        stage, ep_rank, off = owner(name.layer, name.expert, num_layers=arch.num_layers, pp=pp,
                                    num_experts=arch.num_experts, ep=ep)
        local = naming.to_megatron(name, off)
        l_local = int(local.split(".")[2])
        assert 0 <= l_local < arch.num_layers // pp and stage < pp and ep_rank < ep
        if name.expert is not None:
            assert 0 <= int(local.split(".")[6]) < arch.num_experts // ep
        assert naming.from_megatron(local, off) == name
        for ab in "AB":
            assert naming.parse_canonical(f"{name.canonical}.lora_{ab}") == (name, ab)
            peft = naming.peft_names(name, ab, arch.num_experts)
            assert len(peft) == len(name.linear.hf)
            for p, part in peft:
                assert naming.parse_peft(p) == (name, part, ab)
                hf = naming.hf_modules(name)[part]
                assert naming.parse_hf_module(hf) == (name, part)
                assert naming.from_vllm(naming.to_vllm(name, part)) == (name, part)
    want = {"qwen3_moe": {"attention", "expert"}, "qwen3_5_moe": {"attention", "linear_attention", "shared", "expert"},
            "qwen3_next": {"attention", "linear_attention", "dense", "shared", "expert"}}
    assert parts == want.get(family, {"attention", "dense", "shared", "expert"})


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("pp,ep", LAYOUTS)
def test_checkpoint_names_round_trip(family, pp, ep):
    """Every tensor of the family's real (tiny) checkpoint maps to the Megatron parameter of its owning rank and
    back."""
    from moe_lora_rl.models import get_model

    arch, naming = ARCHS[family], naming_for(family)
    names = list(HFCheckpoint(get_model(family, "tiny")).weight_map)
    assert names
    for hf in names:
        bits = hf.split(".")
        layer = int(bits[2]) if bits[1] == "layers" else 0
        expert = int(bits[5]) if ".mlp.experts." in hf else None
        _, _, off = owner(layer, expert, num_layers=arch.num_layers, pp=pp, num_experts=arch.num_experts, ep=ep)
        meg, i = naming.megatron_param(hf, off)
        assert naming.resolve(meg, off).hf_names[i] == hf, (hf, meg)


def test_hand_written_examples():
    g, q = naming_for("glm4_moe"), naming_for("qwen3_moe")
    # glm4 tiny: 4 layers, 16 experts; at pp2ep2 global layer 3 is stage 1's layer 1, expert 13 is EP rank 1's 5
    stage, ep_rank, off = owner(3, 13, num_layers=4, pp=2, num_experts=16, ep=2)
    assert (stage, ep_rank, off) == (1, 1, Offsets(2, 8))
    name = g.from_megatron("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1", off)
    assert name.canonical == "layers.3.mlp.experts.13.linear_fc1"
    assert g.peft_names(name, "A", 16) == [
        ("base_model.model.model.layers.3.mlp.experts.13.gate_proj.lora_A.weight", 0),
        ("base_model.model.model.layers.3.mlp.experts.13.up_proj.lora_A.weight", 1)]
    assert g.to_vllm(name, 1) == VllmName("model.layers.3.mlp.experts.w13_weight", 13, 1)
    shared = g.parse_canonical("layers.2.mlp.experts.linear_fc1.lora_A")[0]      # shared_outer's A
    assert [p for p, _ in g.peft_names(shared, "A", 16)][30] == \
        "base_model.model.model.layers.2.mlp.experts.15.gate_proj.lora_A.weight"
    qkv = q.from_megatron("decoder.layers.0.self_attention.linear_qkv", Offsets(1, 0))
    assert [q.to_vllm(qkv, i) for i in range(3)] == [VllmName("model.layers.1.self_attn.qkv_proj", None, i)
                                                     for i in range(3)]
    assert q.resolve("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", Offsets(2, 8)).hf_names == \
        ("model.layers.3.mlp.experts.11.gate_proj.weight", "model.layers.3.mlp.experts.11.up_proj.weight")
    assert g.resolve("decoder.layers.0.mlp.router.expert_bias", Offsets(1, 0)).hf_names == \
        ("model.layers.1.mlp.gate.e_score_correction_bias",)
    assert g.vllm_linears()["mlp.shared_experts.gate_up_proj"] == ("mlp.shared_experts.gate_proj",
                                                                  "mlp.shared_experts.up_proj")
    # negative control: another rank's offsets give another global name
    assert g.from_megatron("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1", Offsets(0, 0)) != name


@pytest.mark.parametrize("call,match", [
    (lambda: naming_for("mixtral"), "no naming module for model family 'mixtral'"),
    (lambda: naming_for("qwen3_moe").resolve("decoder.layers.0.foo.weight", Offsets()),
     "no HF name known for Megatron parameter 'decoder.layers.0.foo.weight'"),
    (lambda: naming_for("qwen3_moe").megatron_param("model.layers.0.mlp.shared_experts.gate_proj.weight", Offsets()),
     "no Megatron parameter known for HF tensor 'model.layers.0.mlp.shared_experts.gate_proj.weight'"),
    (lambda: naming_for("glm4_moe").parse_canonical("layers.0.mlp.router.lora_A"),
     "'layers.0.mlp.router.lora_A' is not a canonical factor"),
    (lambda: naming_for("glm4_moe").parse_peft("base_model.model.model.layers.0.mlp.foo.lora_A.weight"),
     "'base_model.model.model.layers.0.mlp.foo.lora_A.weight': no module 'mlp.foo'"),
    (lambda: naming_for("glm4_moe").parse_peft("model.layers.0.mlp.gate_proj.weight"),
     "'model.layers.0.mlp.gate_proj.weight' is not a PEFT LoRA name"),
    (lambda: naming_for("glm4_moe").from_megatron("decoder.layers.0.mlp.router", Offsets()),
     "'decoder.layers.0.mlp.router' is not an adaptable linear"),
    (lambda: naming_for("glm4_moe").from_vllm(VllmName("model.layers.0.mlp.experts.w13_weight", None, 0)),
     "w13_weight"),
    (lambda: owner(0, 3, num_layers=4, pp=3, num_experts=16, ep=2), "num_layers=4 .* pipeline parallel size 3"),
])
def test_unknown_names_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# MLA: test_naming_mla.py; the hybrid's gated q_proj and delta-net rows: test_naming_hybrid.py
@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if not ARCHS[f].mla and not ARCHS[f].layer_types))
def test_peft_split_by_shards_equals_whole(family):
    """Filling PEFT tensors shard by shard (the streaming gather) equals the whole-factor split; q/k/v and gate/up
    rows land where HF expects them (checked against a hand-built fused tensor)."""
    arch = ARCHS[family]
    r, hd, g = 3, arch.head_dim, arch.num_kv_heads
    qpg = arch.num_heads // g
    q = torch.randn(arch.num_heads * hd, r)
    k, v = torch.randn(g * hd, r), torch.randn(g * hd, r)
    fused = torch.cat([q.reshape(g, qpg, hd, r), k.reshape(g, 1, hd, r), v.reshape(g, 1, hd, r)], 1).reshape(-1, r)
    gate, up = torch.randn(arch.moe_ffn_hidden_size, r), torch.randn(arch.moe_ffn_hidden_size, r)
    A = torch.randn(r, arch.hidden_size)
    adapters = {"layers.1.self_attention.linear_qkv.lora_B": fused, "layers.1.self_attention.linear_qkv.lora_A": A,
                "layers.1.mlp.experts.linear_fc1.lora_A": A, "layers.1.mlp.experts.linear_fc1.lora_B":
                torch.stack([gate, up])}
    whole = to_peft_tensors(adapters, arch)
    P = "base_model.model.model.layers.1."
    assert torch.equal(whole[P + "self_attn.q_proj.lora_B.weight"], q)
    assert torch.equal(whole[P + "self_attn.v_proj.lora_B.weight"], v)
    assert torch.equal(whole[P + f"mlp.experts.{arch.num_experts - 1}.up_proj.lora_B.weight"], up)
    for factor, t in adapters.items():
        dim = (1 if t.dim() == 3 else 0) if "lora_B" in factor else 1
        for o in peft_outputs(arch, factor, tuple(t.shape)):
            buf = torch.full(o.shape, float("nan"))
            for i, shard in enumerate(t.chunk(2, dim=dim)):
                for region, piece in place(o, shard, i, 2, dim, arch):
                    buf[region] = piece
            assert torch.equal(buf, whole[o.name]), o.name
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj: incomplete, has only lora_B"):
        to_peft_tensors({k: t for k, t in adapters.items() if "qkv.lora_A" not in k}, arch)


def test_engine_side_names():
    from moe_lora_rl.models import get_model
    from moe_lora_rl.models.naming import layer_of
    from moe_lora_rl.vllm.moe_torch import load_base_experts

    g, q = naming_for("glm4_moe"), naming_for("qwen3_moe")
    assert g.expert_weights(2, 7) == tuple(f"model.layers.2.mlp.experts.7.{p}_proj.weight" for p in
                                           ("gate", "up", "down"))
    assert g.router_weights(1) == ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias")
    assert q.router_weights(1) == ("model.layers.1.mlp.gate.weight", None)
    assert q.expert_modules(3) == ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj", "mlp.experts.3.down_proj")
    assert [layer_of(n) for n in ("model.layers.12.mlp.experts.w13_weight", "layers.3.self_attention.linear_qkv",
                                  "decoder.layers.0.mlp.router", "model.norm.weight")] == [12, 3, 0, None]
    for family, arch in ARCHS.items():                           # the engine's expert weights read by these names
        from moe_lora_rl.models.checkpoint import HFCheckpoint

        ckpt = HFCheckpoint(get_model(family, "tiny"))
        layer = arch.moe_layer_ids[0]
        base = load_base_experts(ckpt, arch, layer, torch.float32)
        E, H, I = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size
        assert base.w13.shape == (E, 2 * I, H) and base.w2.shape == (E, H, I)
        assert (base.bias is not None) == arch.expert_bias
        last = E - 1                                             # gate rows then up rows, in expert order
        assert torch.equal(base.w13[last, :I], ckpt.get(f"model.layers.{layer}.mlp.experts.{last}.gate_proj.weight"))
        assert torch.equal(base.w13[last, I:], ckpt.get(f"model.layers.{layer}.mlp.experts.{last}.up_proj.weight"))
