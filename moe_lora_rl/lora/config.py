"""LoRA configuration: what to adapt, with which rank/alpha, in which adapter layout."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..models.naming import MEGATRON
from ..models.naming.tables import ROUTER_TARGET, SHARED_GATE_TARGET

# target names (the linears of models/naming, plus "router" and "shared_gate" so that naming them gives a clear error)
TARGETS: tuple[str, ...] = tuple(li.target for li in MEGATRON.linears) + (ROUTER_TARGET[0], SHARED_GATE_TARGET[0])
GROUPS: dict[str, tuple[str, ...]] = {
    "experts": ("expert_fc1", "expert_fc2"),
    "attention": ("qkv", "proj", "q_down", "q_up", "q", "kv_down", "kv_up",     # GQA's, MLA's and the delta-net's:
                  "linear_in", "linear_out"),                                     # what the model has
    "dense_mlp": ("dense_fc1", "dense_fc2"),
    "shared_experts": ("shared_fc1", "shared_fc2"),
}
# verl's / Megatron-Bridge's module names (actor_rollout_ref.model.lora.target_modules) -> ours. linear_fc1/2 name
# every fc1/fc2 a model has (dense MLP, shared expert, routed experts), as Megatron-Bridge matches them.
ALIASES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("qkv",), "linear_proj": ("proj",), "linear_q_down_proj": ("q_down",),
    "linear_q_up_proj": ("q_up",), "linear_q_proj": ("q",), "linear_kv_down_proj": ("kv_down",),
    "linear_kv_up_proj": ("kv_up",), "in_proj": ("linear_in",), "out_proj": ("linear_out",), "linear_fc1": ("dense_fc1", "shared_fc1", "expert_fc1"),
    "linear_fc2": ("dense_fc2", "shared_fc2", "expert_fc2"),
}
ALL = ("experts", "attention", "dense_mlp", "shared_experts")      # "all": whatever of these the model has
LAYOUTS = ("per_expert", "shared_outer", "shared")
DTYPES = ("float32", "bfloat16", "float16")


def expand(target: str) -> tuple[str, ...]:
    """The concrete target names of a target, group, alias or "all"."""
    if target == "all":
        return tuple(n for g in ALL for n in GROUPS[g])
    return GROUPS.get(target) or ALIASES.get(target) or (target,)


A_INITS = ("kaiming", "xavier")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    """LoRA rank r (> 0)."""
    alpha: float = 32.0
    """Scale is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    targets: tuple[str, ...] = ("all",)
    """Target names or groups (see TARGETS / GROUPS); "all" = experts, attention, dense MLP and shared experts that
    exist in the model. An explicitly named target that matches no layer is an error. The router is never adapted
    unless "router" is named."""
    adapter_layout: str = "per_expert"
    """per_expert: each routed expert its own A and B. shared_outer: one A shared by all experts of a layer for fc1
    and one B for fc2, per-expert inner factors. shared: one A/B per layer for all experts (upstream's default, here
    shared across EP ranks so it does not change with the EP degree)."""
    dtype: str = "float32"
    """Adapter parameter dtype."""
    init_seed: int = 0
    """Seed for A's initialisation; A is drawn per adapter from its global name, so init is layout-independent."""
    a_init: str = "kaiming"
    """A's initialisation: kaiming (uniform, a=sqrt(5): PEFT's and nn.Linear's) or xavier (uniform over
    fan_in + rank: Megatron-Bridge's lora_A_init_method="xavier", verl's default). B starts at zero either way."""
    explicit: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got rank={self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got alpha={self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got dropout={self.dropout!r}")
        if self.adapter_layout not in LAYOUTS:
            raise ValueError(f"adapter_layout={self.adapter_layout!r}; choose one of {LAYOUTS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {DTYPES}")
        if self.a_init not in A_INITS:
            raise ValueError(f"a_init={self.a_init!r}; choose one of {A_INITS}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets:
            raise ValueError("LoRA targets is empty")
        known = set(TARGETS) | set(GROUPS) | set(ALIASES) | {"all"}
        bad = [t for t in targets if t not in known]
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; known: {sorted(known)}")
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "explicit", tuple(t for t in targets if t != "all"))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def unmatched(self, adaptable: set[str]) -> list[str]:
        """The explicitly named targets (or groups, or aliases) none of whose linears is among `adaptable`."""
        return [t for t in self.explicit if not set(expand(t)) & adaptable]

    def check_model(self, adaptable: set[str], where: str = "lora.targets") -> None:
        """ValueError naming each explicitly named target the model has no linear for, and what it accepts
        (`adaptable`: models.arch.MoEArch.adaptable())."""
        bad = self.unmatched(adaptable)
        if bad:
            raise ValueError(f"{where}: {bad} name no linear of this model; it accepts {sorted(adaptable)} (and the "
                             "groups/aliases that contain them)")

    def resolved_targets(self) -> tuple[str, ...]:
        """Concrete target names, expanded from groups, aliases and "all"."""
        out: list[str] = []
        for t in self.targets:
            out += [n for n in expand(t) if n not in out]
        return tuple(out)

    def expert_factors_shared(self, target: str) -> tuple[bool, bool]:
        """(A, B) of a routed-expert target shared by all experts of a layer, by adapter layout."""
        if self.adapter_layout == "shared":
            return True, True
        if self.adapter_layout == "shared_outer":
            return (True, False) if target == "expert_fc1" else (False, True)
        return False, False

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                "adapter_layout": self.adapter_layout, "dtype": self.dtype, "init_seed": self.init_seed}

    @classmethod
    def from_dict(cls, d: dict) -> "LoRAConfig":
        return cls(**{**d, "targets": tuple(d["targets"])})

    def check_compatible(self, other: "LoRAConfig", where: str) -> None:
        """A checkpoint written with `other` can be loaded into adapters built with self only if the shapes and
        the function they compute agree: rank, alpha, layout and targets."""
        for k in ("rank", "alpha", "adapter_layout"):
            if getattr(self, k) != getattr(other, k):
                raise ValueError(f"{where}: LoRA {k} mismatch: checkpoint has {getattr(other, k)!r}, "
                                 f"the model's adapters have {getattr(self, k)!r}")
        if set(self.resolved_targets()) != set(other.resolved_targets()):
            raise ValueError(f"{where}: LoRA targets mismatch: checkpoint {sorted(other.resolved_targets())}, "
                             f"model {sorted(self.resolved_targets())}")
