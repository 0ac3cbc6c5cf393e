"""The hybrid linear-attention family as data (models/hybrid.py, naming/qwen3_5_moe.py, tiny_hybrid.py): the config
reader on the text model, the released multimodal layout and Qwen3-Next; every adaptable module's shape against the
HF model transformers builds; hand-written names that pin the mapping; the released layout's vision tower and MTP
layers set aside and counted; refusals naming the value. (test_naming.py round-trips every name of these families
with the others.)"""
import dataclasses

import pytest
import torch

from moe_lora_rl.megatron.run_config import RunConfig
from moe_lora_rl.models import get_model
from moe_lora_rl.models.arch import arch_from_hf_config, load_arch
from moe_lora_rl.models.checkpoint import HFCheckpoint
from moe_lora_rl.models.naming import AdapterName, Offsets, VllmName, naming_for
from moe_lora_rl.models.tiny import SPECS, build_hf_config


def test_reader_text_model_released_layout_and_qwen3_next():
    text, vl = load_arch(get_model("qwen3_5_moe", "tiny")), load_arch(get_model("qwen3_5_moe", "tiny_vl"))
    assert text.family == vl.family == "qwen3_5_moe"
    assert text.layer_types == ("linear_attention",) * 3 + ("full_attention",) and text.linear_layer_ids == [0, 1, 2]
    assert (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
            text.linear_conv_kernel) == (2, 4, 32, 4)
    assert text.attention_output_gate and text.shared_expert_gate and text.zero_centered_norms
    assert text.rotary_percent == 0.25 and text.score_function == "softmax" and not text.pre_softmax
    assert all(text.moe_layers) and text.shared_expert_ffn == 64 and not text.text_tower
    # the released layout reads the same text tower: only where it came from differs
    differ = {f.name for f in dataclasses.fields(text) if getattr(text, f.name) != getattr(vl, f.name)}
    assert differ == {"text_tower", "mtp_layers"} and vl.text_tower and vl.mtp_layers == 1 and vl.mtp_layer_ids == []
    nxt = load_arch(get_model("qwen3_next", "tiny"))
    assert nxt.family == "qwen3_next" and nxt.fused_linear_proj and nxt.moe_layers == (True, False, True, True)
    assert nxt.layer_types[1] == "full_attention" and naming_for(nxt).family == "qwen3_next"


@pytest.mark.parametrize("family,size", [("qwen3_5_moe", "tiny"), ("qwen3_next", "tiny")])
def test_adaptable_shapes_are_the_hf_models(family, size):
    """(in, out) of every adaptable module the naming lists per layer type = the HF module's weight, and the modules
    of the other layer type are absent from that layer."""
    import transformers

    cfg = build_hf_config(family, size)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    arch = arch_from_hf_config(cfg)
    naming = naming_for(arch)
    mods = dict(model.named_modules())
    for layer in range(arch.num_layers):
        shapes = naming.hf_shapes(arch, layer)
        assert shapes
        for module, (i, o) in shapes.items():
            if "{E}" in module:                      # fused in memory: gate_up_proj [E, 2 ffn, in], down [E, out, ffn]
                w = mods[f"model.layers.{layer}.mlp.experts"]
                got = (w.gate_up_proj.shape[2], w.gate_up_proj.shape[1] // 2) if "down" not in module \
                    else (w.down_proj.shape[2], w.down_proj.shape[1])
            else:
                w = mods[f"model.layers.{layer}." + module].weight
                got = (w.shape[1], w.shape[0])
            assert got == (i, o), (layer, module)
        other = "self_attn." if arch.layer_types[layer] == "linear_attention" else "linear_attn."
        assert not any(k.startswith(other) for k in shapes)


def test_hand_written_examples():
    n = naming_for("qwen3_5_moe")
    res = n.resolve("decoder.layers.1.self_attention.in_proj.weight", Offsets(2, 0))
    assert res.hf_names == tuple(f"model.layers.3.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))
    assert res.row.kind == "gdn_in"
    for meg, hf, kind in (("self_attention.conv1d.weight", "linear_attn.conv1d.weight", "gdn_conv"),
                          ("self_attention.A_log", "linear_attn.A_log", "column"),
                          ("self_attention.out_norm.weight", "linear_attn.norm.weight", "replicated"),
                          ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", "plus_one"),
                          ("input_layernorm.weight", "input_layernorm.weight", "plus_one"),
                          ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight", "replicated"),
                          ("self_attention.linear_qkv.weight", "self_attn.q_proj.weight", "qkv_gated")):
        r = n.resolve(f"decoder.layers.0.{meg}", Offsets())
        assert (r.hf_names[0], r.row.kind) == (f"model.layers.0.{hf}", kind)
    lin = n.from_megatron("decoder.layers.0.self_attention.in_proj", Offsets(2, 0))
    assert lin == AdapterName(n.linear("linear_in"), 2, None)
    assert [n.to_vllm(lin, p) for p in range(4)] == [
        VllmName("model.layers.2.linear_attn.in_proj_qkvz", None, 0),
        VllmName("model.layers.2.linear_attn.in_proj_qkvz", None, 1),
        VllmName("model.layers.2.linear_attn.in_proj_ba", None, 0),
        VllmName("model.layers.2.linear_attn.in_proj_ba", None, 1)]
    assert n.vllm_linears()["linear_attn.in_proj_ba"] == ("linear_attn.in_proj_b", "linear_attn.in_proj_a")
    assert n.peft_names(lin, "B", 8)[3] == ("base_model.model.model.layers.2.linear_attn.in_proj_a.lora_B.weight", 3)
    nxt = naming_for("qwen3_next")
    assert nxt.resolve("decoder.layers.0.self_attention.in_proj.weight", Offsets()).hf_names == (
        "model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight")
    # negative controls: the other family's fused name, and Qwen3.5's unfused one on Qwen3-Next, are unknown
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        n.megatron_param("model.layers.0.linear_attn.in_proj_qkvz.weight", Offsets())
    with pytest.raises(ValueError, match="in_proj_qkv.weight"):
        nxt.megatron_param("model.layers.0.linear_attn.in_proj_qkv.weight", Offsets())


def test_released_layout_reads_the_text_tower_and_sets_the_rest_aside():
    text, vl = HFCheckpoint(get_model("qwen3_5_moe", "tiny")), HFCheckpoint(get_model("qwen3_5_moe", "tiny_vl"))
    assert set(vl.weight_map) == set(text.weight_map) and vl.text_tower and not text.text_tower
    assert vl.left_out == {"model.visual.": 21, "mtp.": 41} and text.left_out == {}
    assert vl.stored_name("model.layers.3.self_attn.q_proj.weight") == \
        "model.language_model.layers.3.self_attn.q_proj.weight"
    assert vl.get("model.norm.weight").shape == (128,)
    assert len(vl.stored_map) == len(vl.weight_map) + 21 + 41
    with pytest.raises(KeyError, match="model.visual.blocks.0.attn.qkv.weight"):
        vl.get("model.visual.blocks.0.attn.qkv.weight")


def _spec(**text):
    spec = dict(SPECS[("qwen3_5_moe", "tiny")])
    spec.update(text)
    return spec


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["linear_attention"] * 3), r"layer_types=.*need 4 entries"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "sliding_attention"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim=0"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_reader_refusals_name_the_value(change, match):
    with pytest.raises(ValueError, match=match):
        arch_from_hf_config(_spec(**change))


def test_megatron_config_of_the_family():
    """The TransformerConfig fields the builder derives (pure): megatron-core's gated delta-net variant with the
    per-layer pattern from layer_types, the delta-net widths, both gates, and no zero-centred gamma (the loader adds
    one to the norms instead: shard kind plus_one)."""
    from moe_lora_rl.megatron.build import transformer_config_kwargs
    from moe_lora_rl.megatron.layout import Layout

    kw = transformer_config_kwargs(load_arch(get_model("qwen3_5_moe", "tiny")), Layout(tp=2), RunConfig())
    assert {k: kw[k] for k in ("experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim",
                               "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                               "linear_num_value_heads", "attention_output_gate", "moe_shared_expert_gate",
                               "layernorm_zero_centered_gamma")} == dict(
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 1, 1, 0],
        linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, attention_output_gate=True, moe_shared_expert_gate=True,
        layernorm_zero_centered_gamma=False)
    nxt = transformer_config_kwargs(load_arch(get_model("qwen3_next", "tiny")), Layout(), RunConfig())
    assert nxt["linear_attention_freq"] == [1, 0, 1, 1] and nxt["moe_layer_freq"] == [1, 0, 1, 1]


def test_megatron_builder_refuses_tp_that_does_not_split_the_delta_net_heads():
    from moe_lora_rl.megatron.build import check_layout
    from moe_lora_rl.megatron.layout import Layout

    arch = load_arch(get_model("qwen3_5_moe", "tiny"))
    check_layout(arch, Layout(tp=2))
    odd = dataclasses.replace(arch, linear_num_key_heads=1, linear_num_value_heads=2)
    with pytest.raises(ValueError, match=r"tp=2 does not divide the delta-net's linear_num_key_heads=1"):
        check_layout(odd, Layout(tp=2))
    check_layout(dataclasses.replace(odd, layer_types=("full_attention",) * 4), Layout(tp=2))


def test_merge_into_the_released_layout_keeps_vision_tower_and_mtp(tmp_path):
    """python -m moe_lora_rl.refit.merged on a Qwen3.5 checkpoint as released: the adapted text-tower tensor changes
    by scale * B @ A under its stored name; every vision-tower and MTP tensor is written back unchanged."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moe_lora_rl.refit.merged import save_merged

    model = get_model("qwen3_5_moe", "tiny_vl")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 128, generator=g), torch.randn(128, 4, generator=g)
    pre = "base_model.model.model.layers.3.self_attn.o_proj"
    save_file({f"{pre}.lora_A.weight": A, f"{pre}.lora_B.weight": B}, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    out = save_merged(model, adapter, tmp_path / "out")
    stored = "model.language_model.layers.3.self_attn.o_proj.weight"
    with safe_open(model / "model.safetensors", "pt") as f0, safe_open(out / "model.safetensors", "pt") as f1:
        assert set(f0.keys()) == set(f1.keys())
        assert torch.allclose(f1.get_tensor(stored) - f0.get_tensor(stored), 2.0 * B @ A, atol=1e-5)
        assert not torch.equal(f1.get_tensor(stored), f0.get_tensor(stored))
        kept = [k for k in f0.keys() if k.startswith(("model.visual.", "mtp."))]
        assert len(kept) == 62 and all(torch.equal(f0.get_tensor(k), f1.get_tensor(k)) for k in kept)


def test_shared_expert_gate_is_refused_as_a_lora_target_in_one_line():
    """The shared expert's gate (a [1, hidden] Parameter megatron-core applies with F.linear) is refused before anything
    is planned; 'all' does not include it, and every linear of the family plans (control: the check lets 'all' by)."""
    from types import SimpleNamespace

    from moe_lora_rl.lora.apply import plan_adapters
    from moe_lora_rl.lora.config import LoRAConfig

    model = SimpleNamespace(config=SimpleNamespace(experimental_attention_variant="gated_delta_net"))
    with pytest.raises(ValueError, match=r"^LoRA target 'shared_gate': .* stays frozen") as e:
        plan_adapters(model, LoRAConfig(targets=("experts", "shared_gate")))
    assert "\n" not in str(e.value)
    assert "shared_gate" not in LoRAConfig(targets=("all",)).resolved_targets()
    with pytest.raises(AttributeError):                 # control: past the check, planning reads the (fake) model
        plan_adapters(model, LoRAConfig(targets=("all",)))


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_lora_b_rows_export_as_the_base_weights_load(family):
    """The delta-net's in_proj and the gated linear_qkv: canonical B factors exported to PEFT (refit/rename.py), then
    assembled by the base weights' own loader (hf_load_hybrid.assemble, the PEFT parts read as weights of r columns)
    give, at every TP rank of tp1 and tp2, exactly the rows the adapter applies there (its shard of key heads reordered
    to in_proj's per-rank [q|k|v|z|b|a] by section_major_rows; linear_qkv's shard as is). Shard-by-shard placement (the
    streaming refit) equals the whole export, the import inverts it, and an adapter whose A differs across the parts
    of one linear is refused in one line. Control: B rows of two sections swapped no longer match."""
    from moe_lora_rl.lora.layers import delta_net_blocks, section_major_rows
    from moe_lora_rl.megatron.hf_load_hybrid import assemble
    from moe_lora_rl.refit.import_peft import from_peft_tensors
    from moe_lora_rl.refit.rename import peft_outputs, place, to_peft_tensors

    arch = load_arch(get_model(family, "tiny"))
    naming, r, g = naming_for(arch), 3, torch.Generator().manual_seed(0)
    blocks = delta_net_blocks(arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_num_key_heads,
                              arch.linear_num_value_heads)
    kh, unit = arch.linear_num_key_heads, sum(blocks)
    lin, full = arch.layer_types.index("linear_attention"), arch.layer_types.index("full_attention")
    qkv_rows = arch.num_kv_heads * (2 * arch.num_heads // arch.num_kv_heads + 2) * arch.head_dim
    adapters = {f"layers.{lin}.self_attention.in_proj.lora_A": torch.randn(r, arch.hidden_size, generator=g),
                f"layers.{lin}.self_attention.in_proj.lora_B": torch.randn(kh, unit, r, generator=g),
                f"layers.{full}.self_attention.linear_qkv.lora_A": torch.randn(r, arch.hidden_size, generator=g),
                f"layers.{full}.self_attention.linear_qkv.lora_B": torch.randn(qkv_rows, r, generator=g)}
    peft = to_peft_tensors(adapters, arch)
    P = "base_model.model.model.layers.{}.{}.lora_{}.weight"
    parts = {t: [peft[P.format(layer, h, "B")] for h in naming.linear(t).hf]
             for t, layer in (("linear_in", lin), ("qkv", full))}
    assert len(parts["linear_in"]) == (2 if arch.fused_linear_proj else 4) and len(parts["qkv"]) == 3
    in_kind = "gdn_in_next" if arch.fused_linear_proj else "gdn_in"
    canon_in, canon_qkv = adapters[f"layers.{lin}.self_attention.in_proj.lora_B"], \
        adapters[f"layers.{full}.self_attention.linear_qkv.lora_B"]
    for size in (1, 2):
        for rank in range(size):
            applied = canon_in.chunk(size)[rank].reshape(-1, r)[section_major_rows(blocks, kh // size)]
            assert torch.equal(applied, assemble(in_kind, parts["linear_in"], arch, rank, size)), (size, rank)
            assert torch.equal(canon_qkv.chunk(size)[rank], assemble("qkv_gated", parts["qkv"], arch, rank, size))
    swapped = canon_in.clone()
    swapped[:, :blocks[0]], swapped[:, blocks[0]:2 * blocks[0]] = canon_in[:, blocks[0]:2 * blocks[0]], \
        canon_in[:, :blocks[0]]                                                  # q and k rows exchanged
    bad = to_peft_tensors({**adapters, f"layers.{lin}.self_attention.in_proj.lora_B": swapped}, arch)
    bad_parts = [bad[P.format(lin, h, "B")] for h in naming.linear("linear_in").hf]
    assert not torch.equal(canon_in.reshape(-1, r)[section_major_rows(blocks, kh)],
                           assemble(in_kind, bad_parts, arch, 0, 1))
    for factor, t in adapters.items():              # the streaming refit's placement, B by TP shard (A is whole)
        if factor.endswith("lora_A"):
            continue
        for o in peft_outputs(arch, factor, tuple(t.shape)):
            buf = torch.full(o.shape, float("nan"))
            for i, shard in enumerate(t.chunk(2, dim=0)):
                for region, piece in place(o, shard, i, 2, 0, arch):
                    buf[region] = piece
            assert torch.equal(buf, peft[o.name]), o.name
    back = from_peft_tensors(peft, arch, {k: tuple(v.shape) for k, v in adapters.items()})
    assert all(torch.equal(back[k], v) for k, v in adapters.items())
    z = P.format(lin, naming.linear("linear_in").hf[-1], "A")
    with pytest.raises(ValueError, match=r"differs from the other copies of adapter factor") as e:
        from_peft_tensors({**peft, z: peft[z] + 1e-3}, arch, {k: tuple(v.shape) for k, v in adapters.items()})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family,source,cls", [("qwen3_5_moe", "qwen3_5.py", "Qwen3_5ForCausalLMBase"),
                                               ("qwen3_next", "qwen3_next.py", "Qwen3NextForCausalLM")])
def test_vllm_slots_are_vllms_lora_packing(family, source, cls):
    """Every exported PEFT module of the attention and delta-net linears lands in the vLLM module and LoRA slice that
    vLLM 0.32's own packed_modules_mapping gives it (read from the installed source: importing the model needs
    torchvision): Qwen3.5's in_proj_qkvz = [in_proj_qkv, in_proj_z], in_proj_ba = [in_proj_b, in_proj_a]; Qwen3-Next's
    fused modules one slice each; qkv_proj = [q_proj (query and gate), k_proj, v_proj]."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed")
    tree = ast.parse((Path(spec.origin).parent / "model_executor" / "models" / source).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    mapping = next(ast.literal_eval(s.value) for s in node.body if isinstance(s, ast.Assign)
                   and getattr(s.targets[0], "id", "") == "packed_modules_mapping")
    naming = naming_for(family)
    checked = 0
    for target in ("linear_in", "linear_out", "qkv", "proj"):
        li = naming.linear(target)
        for part, hf in enumerate(li.hf):
            module, sl = li.vllm_slot(part)
            prefix, leaf = module.rsplit(".", 1)
            packed = mapping.get(leaf, [leaf])                     # a module vLLM does not pack: one slice, itself
            assert prefix == hf.rsplit(".", 1)[0] and packed[sl] == hf.rsplit(".", 1)[1], (target, hf, module, sl)
            checked += 1
    assert checked == (9 if family == "qwen3_5_moe" else 7)
