"""Our DeepSeek-V3 (MLA) HF <-> Megatron names and MLA config against a reference we did not write: megatron-bridge's
DeepSeek-V3 mappings (megatron/bridge/models/deepseek/common.py) and its MLA provider. Runs in .venv312 (Python 3.12,
megatron-bridge 0.6) where megatron-bridge is installed; skipped with the reason elsewhere.

For every Megatron parameter our builder has (both q_lora_rank variants, local and TE spec names), the bridge's
mapping with the same Megatron name must give the same HF tensor(s); the MTP layer's HF tensors are the ones the
bridge maps to its own MTP block (mtp.layers.*), never to decoder layers; the MLA widths and RoPE parameters our
builder passes to MLATransformerConfig equal the bridge provider's.
"""
import fnmatch
import inspect
import re

import pytest

bridge_common = pytest.importorskip("megatron.bridge.models.deepseek.common",
                                    reason="megatron-bridge is not installed in this environment (it is in .venv312 "
                                           "when set up with megatron-bridge 0.6)")

from moe_lora_rl.megatron.build import mla_kwargs  # noqa: E402
from moe_lora_rl.models.arch import arch_from_hf_config  # noqa: E402
from moe_lora_rl.models.naming import Offsets, naming_for  # noqa: E402
from moe_lora_rl.models.tiny import build_hf_config  # noqa: E402

SIZES = ("tiny", "tiny_rope", "tiny_lite")


def _mappings(cfg):
    fn = bridge_common.get_common_mapping_list
    maps = fn(hf_config=cfg) if "hf_config" in inspect.signature(fn).parameters else fn()
    out = []
    for m in maps:
        hf = m.hf_param
        out.append((m.megatron_param, tuple(hf.values()) if isinstance(hf, dict) else (hf,)))
    return out


def _bridge_hf(maps, megatron_name: str):
    """The bridge's HF tensors for a global Megatron name: its '*' wildcards filled in order."""
    for meg, hfs in maps:
        if fnmatch.fnmatchcase(megatron_name, meg):
            pat = "^" + re.escape(meg).replace(r"\*", r"(\d*)") + "$"
            groups = list(re.match(pat, megatron_name).groups())
            filled = []
            for h in hfs:
                it = iter(groups)
                filled.append(re.sub(r"\*", lambda _: next(it), h))
            return tuple(filled)
    return None


def _our_params(arch):
    naming = naming_for(arch)
    for row in naming.params:
        if row.kind.startswith("grouped_"):
            continue                                        # legacy GroupedMLP: not a per-name mapping
        layers = range(arch.num_layers) if "{l}" in row.megatron else [None]
        for layer in layers:
            experts = [0, arch.num_experts - 1] if "{e}" in row.megatron else [None]
            for e in experts:
                name = row.megatron.replace("{l}", str(layer)).replace("{e}", str(e))
                yield name, naming.resolve(name, Offsets()).hf_names


@pytest.mark.parametrize("size", SIZES)
def test_megatron_to_hf_names_match_bridge(size):
    cfg = build_hf_config("deepseek_v3", size)
    arch = arch_from_hf_config(cfg)
    maps = _mappings(cfg)
    checked, mla = 0, 0
    for name, ours in _our_params(arch):
        theirs = _bridge_hf(maps, name)
        if theirs is None:
            # names the bridge does not map: the GQA/qwen rows are not in our MLA naming; expert_bias is added by the
            # bridge class itself (mapping_registry), with the same HF name as ours
            assert name.endswith("mlp.router.expert_bias"), name
            assert ours[0].endswith("mlp.gate.e_score_correction_bias")
            continue
        assert theirs == ours, (name, theirs, ours)
        checked += 1
        mla += ".self_attention." in name
    assert mla >= arch.num_layers * (5 if arch.q_lora_rank else 3)
    # negative control: a wrong table is caught (the q and kv down projections swapped)
    assert _bridge_hf(maps, "decoder.layers.0.self_attention.linear_q_down_proj.weight") != \
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",)


def test_mtp_tensors_map_to_the_bridge_mtp_block_only():
    cfg = build_hf_config("deepseek_v3", "tiny_rope")
    arch = arch_from_hf_config(cfg)
    assert arch.mtp_layers == 1
    mtp_prefix = f"model.layers.{arch.num_layers}."
    targets = [meg for meg, hfs in _mappings(cfg) if any(h.startswith(mtp_prefix) for h in hfs)]
    assert targets and all(t.startswith("mtp.") for t in targets), targets


@pytest.mark.parametrize("size", SIZES)
def test_mla_config_matches_bridge_provider(size):
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    cfg = build_hf_config("deepseek_v3", size)
    arch = arch_from_hf_config(cfg)
    provider = AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    ours = mla_kwargs(arch)
    keys = ["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_base"]
    if arch.rope_type == "yarn":
        keys += ["rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim"]
    got = {k: getattr(provider, k) for k in keys}
    assert got == {k: ours[k] for k in keys}, (got, ours)
    assert provider.num_attention_heads == arch.num_heads and provider.hidden_size == arch.hidden_size
    # the MLA weight shapes both imply (Megatron [out, in]) equal our HF shapes
    shapes = naming_for(arch).hf_shapes(arch, 0)
    h, n = provider.hidden_size, provider.num_attention_heads
    q_head = provider.qk_head_dim + provider.qk_pos_emb_head_dim
    want = {"self_attn.kv_a_proj_with_mqa": (h, provider.kv_lora_rank + provider.qk_pos_emb_head_dim),
            "self_attn.kv_b_proj": (provider.kv_lora_rank, n * (provider.qk_head_dim + provider.v_head_dim)),
            "self_attn.o_proj": (n * provider.v_head_dim, h)}
    if provider.q_lora_rank:
        want.update({"self_attn.q_a_proj": (h, provider.q_lora_rank),
                     "self_attn.q_b_proj": (provider.q_lora_rank, n * q_head)})
    else:
        want["self_attn.q_proj"] = (h, n * q_head)
    assert {k: shapes[k] for k in want} == want
