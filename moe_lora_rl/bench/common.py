"""Shared bench plumbing: model selection (--model DIR or the project's tiny models), layout grouping, JSON out."""
from __future__ import annotations

import json
import sys
from collections import OrderedDict

from ..megatron.layout import Layout

DEFAULT_LAYOUTS = "tp1ep1pp1,tp2ep2,tp2ep2etp2,ep4,pp2ep2"


def resolve_models(model_args: list[str] | None, size: str = "tiny") -> list[str]:
    """--model DIR (repeatable, or comma-separated) or, by default, both project models of `size`."""
    from ..models import FAMILIES, get_model

    if model_args:
        return [m for arg in model_args for m in arg.split(",") if m]
    return [str(get_model(f, size)) for f in FAMILIES]


def group_by_world(layout_names: str) -> "OrderedDict[int, list[str]]":
    """Layouts keyed by the smallest world size megatron-core accepts for each (one torchrun launch per size)."""
    groups: OrderedDict[int, list[str]] = OrderedDict()
    for name in [n.strip() for n in layout_names.split(",") if n.strip()]:
        groups.setdefault(Layout.parse(name).min_world_size, []).append(name)
    return OrderedDict(sorted(groups.items()))


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
