"""Parallel layouts: parse "tp2ep2etp2"-style names and check them against a model before any process group exists.

A layout name is any combination of tpN, etpN, epN, ppN in any order; a missing size is 1. The smallest world size
megatron-core accepts is lcm(tp*pp, etp*ep*pp): attention ranks (tp x dp x pp) and expert ranks (etp x ep x edp x pp)
must tile the same world.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"(etp|tp|ep|pp)(\d+)")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in ("tp", "ep", "etp", "pp"):
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {axis}={v!r}: every parallel size must be an integer >= 1")

    @classmethod
    def parse(cls, name: str) -> "Layout":
        text = name.strip().lower()
        pos, sizes = 0, {}
        for m in _TOKEN.finditer(text):
            if m.start() != pos:
                break
            axis = m.group(1)
            if axis in sizes:
                raise ValueError(f"layout {name!r}: {axis} given twice")
            sizes[axis] = int(m.group(2))
            pos = m.end()
        if pos != len(text) or not text:
            raise ValueError(
                f"layout {name!r} is not a combination of tpN, etpN, epN, ppN (e.g. 'tp2ep2', 'pp2ep2', 'ep4')"
            )
        return cls(**sizes)

    @property
    def name(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in ("tp", "ep", "etp", "pp") if getattr(self, a) > 1]
        return "".join(parts) or "tp1ep1pp1"

    @property
    def min_world_size(self) -> int:
        return math.lcm(self.tp * self.pp, self.etp * self.ep * self.pp)

    def check_world_size(self, world_size: int) -> None:
        dense, expert = self.tp * self.pp, self.etp * self.ep * self.pp
        if world_size % dense or world_size % expert:
            raise ValueError(
                f"world size {world_size} does not fit layout {self.name}: it must be a multiple of tp*pp={dense} "
                f"and of etp*ep*pp={expert}; the smallest that works is {self.min_world_size}"
            )

    def check_model(self, *, num_layers: int, num_heads: int, num_kv_heads: int, num_experts: int,
                    moe_ffn: int, ffn: int | None) -> None:
        """Raise ValueError naming the first size this layout does not divide, and what would work."""
        def need(value: int, by: int, what: str, axis: str):
            if value % by:
                ok = [d for d in range(1, value + 1) if value % d == 0]
                raise ValueError(f"layout {self.name}: {axis}={by} does not divide {what}={value}; "
                                 f"{axis} must be one of {ok}")
        need(num_layers, self.pp, "num_layers", "pp")
        need(num_heads, self.tp, "num_attention_heads", "tp")
        need(num_kv_heads, self.tp, "num_key_value_heads", "tp")
        if ffn is not None:                          # None: the model has no dense MLP layer
            need(ffn, self.tp, "intermediate_size", "tp")
        if num_experts:
            need(num_experts, self.ep, "num_experts", "ep")
            need(moe_ffn, self.etp, "moe_intermediate_size", "etp")


def parse_layouts(text: str) -> list[Layout]:
    return [Layout.parse(t) for t in text.split(",") if t.strip()]
