"""Our DeepSeek-V3 (MLA) HF <-> Megatron names and MLA config against a reference we did not write: megatron-bridge's
DeepSeek-V3 mappings (megatron/bridge/models/deepseek/common.py) and its MLA provider. Runs in .venv312, where
`bash scripts/setup.sh --compat` installs megatron-bridge 0.6.2 with --no-deps into .venv312/megatron-bridge (its
own pins would replace our transformers and megatron-core); skipped with the reason where that folder is absent.
The bridge's modules are imported for real (see _bridge: its package __init__s are skipped, and transformer_engine,
which its PEFT module imports at load time, is a placeholder while AutoBridge is imported and called).

For every Megatron parameter our builder has (both q_lora_rank variants, local and TE spec names), the bridge's
mapping with the same Megatron name must give the same HF tensor(s); the MTP layer's HF tensors are the ones the
bridge maps to its own MTP block (mtp.layers.*), never to decoder layers; the MLA widths and RoPE parameters our
builder passes to MLATransformerConfig equal the bridge provider's.
"""
import contextlib
import fnmatch
import importlib
import inspect
import os
import re
import sys
import types
from pathlib import Path

import pytest

from moe_lora_rl.megatron.build import mla_kwargs
from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.naming import Offsets, naming_for
from moe_lora_rl.models.tiny import build_hf_config

BRIDGE_DIR = Path(sys.prefix) / "megatron-bridge"
pytestmark = pytest.mark.skipif(
    not (BRIDGE_DIR / "megatron" / "bridge" / "models" / "deepseek" / "common.py").is_file(),
    reason=f"megatron-bridge is not installed at {BRIDGE_DIR} (bash scripts/setup.sh --compat puts it in .venv312)")


class _GpuOnly(types.ModuleType):
    """Stands in for transformer_engine while megatron-bridge's modules are imported: every attribute is another
    placeholder (usable as a base class), so class bodies and annotations that name it evaluate; calling one raises."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _GpuOnly(f"{self.__name__}.{attr}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self.__name__} is GPU-only and stubbed for an import of megatron-bridge")

    def __mro_entries__(self, bases):
        return (type(self.__name__.rsplit(".", 1)[-1], (), {}),)


@contextlib.contextmanager
def _bridge(*modules: str, stub_te: bool = False):
    """megatron-bridge's own modules, imported for real from BRIDGE_DIR, without running its package __init__s
    (megatron/bridge/__init__.py imports every model family, diffusion, PEFT and transformer_engine, which this
    CPU venv lacks): each bridge package is put in sys.modules bare, with its real __path__, inside this context
    alone (the bridge imports more of itself lazily when called), then every megatron.bridge entry is taken out
    again; the yielded module objects keep what they imported.
    stub_te: transformer_engine (imported at module level by megatron/bridge/peft/lora_layers.py) is a _GpuOnly for
    this context alone; megatron.core must not be imported meanwhile (it would record TE as present for the rest of
    the process), else it raises."""
    root = BRIDGE_DIR / "megatron" / "bridge"
    ours = ("megatron.bridge.", "transformer_engine.")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "transformer_engine"
             or k == "megatron.bridge" or k.startswith("megatron.bridge.")}
    before = set(sys.modules)
    try:
        for d, _, files in os.walk(root):
            if "__init__.py" in files:
                name = ".".join(Path(d).relative_to(BRIDGE_DIR).parts)
                pkg = types.ModuleType(name)
                pkg.__path__, pkg.__package__ = [d], name
                sys.modules[name] = pkg
        if stub_te:
            # the bridge's model providers pull in megatron.core's model modules: imported first, with no stub
            importlib.import_module("megatron.bridge.models.mla_provider")
            before = set(sys.modules)
            sys.modules["transformer_engine"] = _GpuOnly("transformer_engine")
            sys.modules["transformer_engine.pytorch"] = sys.modules["transformer_engine"].pytorch
        yield [importlib.import_module(m) for m in modules]
        if stub_te:
            core = sorted(m for m in set(sys.modules) - before if m.startswith("megatron.core"))
            assert not core, f"megatron.core modules imported under the transformer_engine stub: {core}"
    finally:
        for k in [k for k in sys.modules if (k + ".").startswith(ours)]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def bridge_common():
    with _bridge("megatron.bridge.models.deepseek.common") as (common,):
        pass
    assert Path(common.__file__).is_relative_to(BRIDGE_DIR), common.__file__
    return common


SIZES = ("tiny", "tiny_rope", "tiny_lite")


def _mappings(bridge_common, cfg):
    """The bridge's entries as (megatron_param, (hf_param, ...)); a GatedMLPMapping's hf_param is {gate, up}."""
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


def _compare(maps, ours):
    """(matched, mismatches) of our (megatron name, hf names) pairs against the bridge's mapping entries."""
    matched, bad = [], []
    for name, hf in ours:
        theirs = _bridge_hf(maps, name)
        if theirs is None:
            bad.append((name, None, hf))
        elif theirs != hf:
            bad.append((name, theirs, hf))
        else:
            matched.append(name)
    return matched, bad


@pytest.mark.parametrize("size", SIZES)
def test_megatron_to_hf_names_match_bridge(bridge_common, size):
    cfg = build_hf_config("deepseek_v3", size)
    arch = arch_from_hf_config(cfg)
    maps = _mappings(bridge_common, cfg)
    ours = list(_our_params(arch))
    matched, bad = _compare(maps, ours)
    assert not bad, bad
    mla = [n for n in matched if ".self_attention." in n]
    assert len(mla) >= arch.num_layers * (5 if arch.q_lora_rank else 3), mla
    assert len(matched) >= len(ours) - arch.num_layers, (len(matched), len(ours))
    # negative control: one of our names perturbed (q down projection given the kv one's HF tensor) is caught
    i = next(i for i, (n, _) in enumerate(ours) if n.endswith("self_attention.linear_kv_down_proj.weight"))
    wrong = ours[i][0].replace("linear_kv_down_proj", "linear_q_down_proj" if arch.q_lora_rank else "linear_q_proj")
    perturbed = [p for p in ours if p[0] != wrong] + [(wrong, ours[i][1])]
    _, caught = _compare(maps, perturbed)
    assert [b[0] for b in caught] == [wrong], caught


def test_mtp_tensors_map_to_the_bridge_mtp_block_only(bridge_common):
    cfg = build_hf_config("deepseek_v3", "tiny_rope")
    arch = arch_from_hf_config(cfg)
    assert arch.mtp_layers == 1
    mtp_prefix = f"model.layers.{arch.num_layers}."
    targets = [meg for meg, hfs in _mappings(bridge_common, cfg) if any(h.startswith(mtp_prefix) for h in hfs)]
    assert targets and all(t.startswith("mtp.") for t in targets), targets


@pytest.mark.parametrize("size", SIZES)
def test_mla_config_matches_bridge_provider(size):
    cfg = build_hf_config("deepseek_v3", size)
    arch = arch_from_hf_config(cfg)
    # deepseek_v3_bridge registers DeepSeekV3Bridge for DeepseekV3ForCausalLM (the package __init__ that would is skipped)
    with _bridge("megatron.bridge.models.conversion.auto_bridge", "megatron.bridge.models.deepseek.deepseek_v3_bridge",
                 stub_te=True) as (auto_bridge, _):
        provider = auto_bridge.AutoBridge.from_hf_config(cfg).to_megatron_provider(load_weights=False)
    assert type(provider).__name__ == "MLAModelProvider", type(provider)
    ours = mla_kwargs(arch)
    keys = ["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_base"]
    if arch.rope_type == "yarn":
        keys += ["rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                 "mscale_all_dim"]
    got = {k: getattr(provider, k) for k in keys}
    assert got == {k: ours[k] for k in keys}, (got, ours)
    # negative control: one of our widths off by one is caught by the same comparison
    assert got != {**{k: ours[k] for k in keys}, "kv_lora_rank": ours["kv_lora_rank"] + 1}
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
