"""Which models and layouts a check runs: --model DIR or the project's tiny models, layouts checked against every
model before any process starts, grouped by the world size they launch at."""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

from ..megatron.layout import Layout

DEFAULT_LAYOUTS = "tp1ep1pp1,tp2ep2,tp2ep2etp2,ep4,pp2ep2"
# the default models of the checks: the GQA families; the MLA ones (deepseek_v3) are named where a check runs them
DEFAULT_FAMILIES = ("glm4_moe", "qwen3_moe")
MLA_SIZES = ("tiny", "tiny_rope", "tiny_lite")        # deepseek_v3: yarn, plain RoPE (+ MTP), q_lora_rank null


def resolve_models(model_args: list[str] | None, size: str = "tiny") -> list[str]:
    """--model DIR (repeatable, or comma-separated) or, by default, both GQA project models of `size`."""
    from ..models import get_model

    if model_args:
        return [m for arg in model_args for m in arg.split(",") if m]
    return [str(get_model(f, size)) for f in DEFAULT_FAMILIES]


def mla_models() -> list[str]:
    """The deepseek_v3 (MLA) tiny variants the installed megatron-core builds: all three on 0.16; on later versions
    not q_lora_rank null (tiny_lite), which megatron/build.py refuses there."""
    from ..megatron.cpu_support import mcore_version
    from ..models import get_model

    sizes = MLA_SIZES if mcore_version().startswith("0.16.") else tuple(s for s in MLA_SIZES if s != "tiny_lite")
    return [str(get_model("deepseek_v3", s)) for s in sizes]


def group_by_world(layout_names: str) -> "OrderedDict[int, list[str]]":
    """Layouts keyed by the smallest world size megatron-core accepts for each (one torchrun launch per size)."""
    groups: OrderedDict[int, list[str]] = OrderedDict()
    for name in [n.strip() for n in layout_names.split(",") if n.strip()]:
        groups.setdefault(Layout.parse(name).min_world_size, []).append(name)
    return OrderedDict(sorted(groups.items()))


def check_layouts(models: list[str], layout_names: str) -> list[Layout]:
    """Every layout parsed and checked against every model before any process starts (ValueError naming the value)."""
    from ..megatron.build import check_layout
    from ..models.arch import load_arch

    names = [n.strip() for n in layout_names.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--layouts {layout_names!r}: no layout given")
    layouts = [Layout.parse(n) for n in names]
    for m in models:
        if not (Path(m) / "config.json").is_file():
            raise ValueError(f"--model {m!r}: not an HF checkpoint directory (no config.json)")
        arch = load_arch(m)
        for layout in layouts:
            check_layout(arch, layout)
    return layouts


def dp_batch(layouts: list[Layout], at_least: int) -> int:
    """A global batch of at least `at_least` sequences that splits over the data-parallel size of every layout at
    the smallest world size it runs at (group_by_world)."""
    step = math.lcm(*[l.min_world_size // (l.tp * l.pp) for l in layouts])
    return step * math.ceil(at_least / step)
