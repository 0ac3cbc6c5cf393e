"""A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, written by refit/export.py or by PEFT's
own save_pretrained, e.g. after an SFT run) checked against our LoRA config and read as per-module PEFT tensors, the
form refit/import_peft.py loads into a sharded model.

    check_adapter_path   the directory, its config and its tensor names (the safetensors header; no tensor is read)
                         against model.lora and the model's config.json: one-line ValueErrors
    read_peft_dir        the tensors, with PEFT's fused-expert form (transformers 5 MoE models keep every expert of a
                         layer in one 3-D parameter, gate_up_proj [E, 2*ffn, hidden] and down_proj [E, hidden, ffn];
                         PEFT adapts them with target_parameters: lora_A [E*r, in], lora_B [out, r*E], expert e's
                         delta B.view(out, r, E)[..., e] @ A.view(E, r, in)[e]) split into the per-expert modules
                         layers.L.mlp.experts.E.{gate,up,down}_proj

What our LoRA holds: one rank and scale for every module, one A shared by a fused linear's outputs (q/k/v, an
expert's gate/up: Megatron's linear_qkv / linear_fc1). PEFT's fused gate_up of rank 2r (its rank_pattern when it
converts per-expert adapters; alpha 2*alpha, the same scale) is the two per-module adapters side by side: read as
rank r when both halves of A are equal (B's halves summed, the same product), refused otherwise. Copies of an A that
differ (an SFT run's independent q/k/v A) are refused by import_peft.from_peft_tensors, naming the tensor.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
KEY = "actor_rollout_ref.model.lora.adapter_path"
# adapter_config.json keys our LoRA cannot reproduce, with the value it needs (absent or None is fine too)
PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none",
              "lora_bias": False, "modules_to_save": None, "layers_to_transform": None, "layer_replication": None,
              "trainable_token_indices": None, "use_qalora": False, "use_bdlora": None}
# architecture fields of config.json that decide whether an adapter fits a model (model_type included)
ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
             "num_experts", "num_experts_per_tok", "n_shared_experts", "shared_expert_intermediate_size",
             "first_k_dense_replace", "q_lora_rank", "kv_lora_rank")
_FUSED = re.compile(r"^(base_model\.model\.model\.layers\.(\d+)\.mlp\.experts)\."
                    r"((?:base_layer\.)*)lora_([AB])\.weight$")


def check_adapter_path(path, lora_cfg, model_path=None, key: str = KEY) -> None:
    """ValueError (one line, naming `key` and the value) unless PATH is a PEFT LoRA directory our LoRA config
    `lora_cfg` (lora/config.py's LoRAConfig) can load exactly: adapter_config.json and adapter_model.safetensors
    present; r and lora_alpha equal to the config's rank and alpha (rank_pattern / alpha_pattern entries only with the
    same alpha / r); a plain LoRA (PLAIN_LORA); the adapted modules, from the tensor names, the targets the config
    resolves to on this model. With MODEL_PATH a local HF directory: the targets are resolved on its architecture, and
    base_model_name_or_path, when it is a local HF directory, and auto_mapping's base class must describe the same
    architecture (ARCH_KEYS of config.json; the weights themselves may differ). Reads JSON and the safetensors header
    only."""
    d = Path(str(path))
    if not d.is_dir():
        raise ValueError(f"{key}={str(path)!r} does not exist (or is not a directory): give a PEFT adapter directory "
                         "or remove the key to start from fresh adapters")
    if not (d / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{key}={str(path)!r} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    if not (d / WEIGHTS).is_file():
        other = sorted(p.name for p in d.glob("adapter_model*"))
        raise ValueError(f"{key}={str(path)!r} has no {WEIGHTS}" + (f" (found {other}: save it with "
                         "safe_serialization=True)" if other else ""))
    try:
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}={str(path)!r}: {ADAPTER_CONFIG} is not JSON ({e})") from None
    for k, need in PLAIN_LORA.items():
        if cfg.get(k) not in (need, None) and not (need is None and not cfg.get(k)):
            raise ValueError(f"{key}={str(path)!r}: {ADAPTER_CONFIG} {k}={cfg.get(k)!r}, our LoRA needs {need!r}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if r != lora_cfg.rank:
        raise ValueError(f"{key}={str(path)!r}: the adapter's r={r!r} differs from actor_rollout_ref.model.lora.rank="
                         f"{lora_cfg.rank}: set the rank to {r!r}")
    if alpha is None or float(alpha) != float(lora_cfg.alpha):
        raise ValueError(f"{key}={str(path)!r}: the adapter's lora_alpha={alpha!r} differs from "
                         f"actor_rollout_ref.model.lora.alpha={lora_cfg.alpha}: set the alpha to {alpha!r}")
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    for pat in sorted(set(ranks) | set(alphas)):
        pr, pa = ranks.get(pat, r), alphas.get(pat, alpha)
        if float(pa) / float(pr) != float(alpha) / float(r) or pr % r:
            raise ValueError(f"{key}={str(path)!r}: {ADAPTER_CONFIG} gives {pat!r} rank {pr} and alpha {pa}: our LoRA "
                             f"has one rank and scale ({r}, {alpha}) for every module")
    arch = _local_arch(model_path)
    if arch is not None:
        _check_base(cfg, Path(str(model_path)), path, key)
        _check_targets(_tensor_shapes(d / WEIGHTS), arch, lora_cfg, path, key)
        _check_shared_a(d / WEIGHTS, arch, lora_cfg.rank, path, key)


def _local_arch(model_path):
    if model_path is None or not (Path(str(model_path)) / "config.json").is_file():
        return None
    from ..models.arch import load_arch

    return load_arch(str(model_path))


def _arch_fields(config_json: Path) -> dict:
    c = json.loads(config_json.read_text())
    c = {**c, **(c.get("text_config") or {})}
    return {k: c[k] for k in ARCH_KEYS if k in c}


def _check_base(cfg: dict, model: Path, path, key: str) -> None:
    ours = json.loads((model / "config.json").read_text())
    cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    if cls and ours.get("architectures") and cls not in ours["architectures"]:
        raise ValueError(f"{key}={str(path)!r} was written for a {cls}, the model {str(model)!r} is a "
                         f"{ours['architectures'][0]}: give an adapter of this model")
    base = cfg.get("base_model_name_or_path")
    if base and (Path(base) / "config.json").is_file():
        theirs, mine = _arch_fields(Path(base) / "config.json"), _arch_fields(model / "config.json")
        diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
        if diff:
            k = diff[0]
            raise ValueError(f"{key}={str(path)!r} was trained on {base!r}, whose {k}={theirs.get(k)!r} differs from "
                             f"the model's {mine.get(k)!r} ({str(model)!r}): give an adapter of this model")


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _check_targets(shapes: dict[str, tuple[int, ...]], arch, lora_cfg, path, key: str) -> None:
    from ..models.naming import naming_for

    naming = naming_for(arch)
    have = set()
    for n, shape in shapes.items():
        m = _FUSED.match(n)
        if m:                                   # a fused expert lora_A [E*r, in]: in = hidden for gate_up_proj
            if m[4] == "A":
                have.add("expert_fc1" if shape[-1] == arch.hidden_size else "expert_fc2")
            continue
        try:
            have.add(naming.parse_peft(n)[0].linear.target)
        except ValueError as e:
            raise ValueError(f"{key}={str(path)!r}: {e}") from None
    want = set(lora_cfg.resolved_targets()) & arch.adaptable()
    if have != want:
        extra, missing = sorted(have - want), sorted(want - have)
        raise ValueError(f"{key}={str(path)!r} adapts {sorted(have)}, actor_rollout_ref.model.lora targets "
                         f"{sorted(want)} on this model" + (f" (the adapter lacks {missing})" if missing else "")
                         + (f" (not targeted: {extra})" if extra else "") + ": set model.lora.target_modules to match")


def _check_shared_a(weights: Path, arch, rank: int, path, key: str) -> None:
    """The A of every fused linear's outputs (q/k/v; an expert's gate/up) the same tensor: our LoRA holds one. Reads
    the lora_A tensors only."""
    from safetensors import safe_open

    from ..models.naming import naming_for

    naming, first = naming_for(arch), {}
    with safe_open(str(weights), "pt") as f:
        for n in f.keys():
            m = _FUSED.match(n)
            if m and m[4] == "A" and f.get_slice(n).get_shape()[-1] == arch.hidden_size:     # gate_up_proj
                a = f.get_tensor(n)
                per = a.reshape(arch.num_experts, -1, a.shape[-1])
                if per.shape[1] == 2 * rank and not torch.equal(per[:, :rank], per[:, rank:]):
                    raise ValueError(f"{key}={str(path)!r}: {n} (gate_up_proj, rank {2 * rank}) has different A "
                                     "halves for gate and up; our LoRA shares one A between them (Megatron's fused "
                                     "linear_fc1): not representable")
                continue
            if m or not n.endswith("lora_A.weight"):
                continue
            name, _, _ = naming.parse_peft(n)
            if len(name.linear.hf) < 2:
                continue
            a = f.get_tensor(n)
            other = first.setdefault(name.canonical, (n, a))
            if not torch.equal(other[1], a):
                raise ValueError(f"{key}={str(path)!r}: {n} differs from {other[0]}; our LoRA shares one A across a "
                                 f"fused linear's outputs (Megatron's {name.linear.megatron.split('.')[-1]}): an "
                                 "adapter trained with independent A's is not representable")


def read_peft_dir(path, arch, rank: int) -> dict[str, torch.Tensor]:
    """PATH's tensors as per-module PEFT tensors (fused-expert tensors split per expert, module docstring), for
    import_peft.load_peft. rank: our LoRA rank (check_adapter_path checked the config)."""
    from safetensors.torch import load_file

    raw = load_file(str(Path(str(path)) / WEIGHTS))
    out, fused = {}, {}
    for n, t in raw.items():
        m = _FUSED.match(n)
        if m:
            fused.setdefault((m[1], int(m[2]), m[3]), {})[m[4]] = t
        else:
            out[n] = t
    for (prefix, layer, nest), ab in sorted(fused.items()):
        where = f"{prefix}.{nest}lora_A/B"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"PEFT tensors {where}: only lora_{''.join(ab)} present")
        out.update(_split_experts(prefix, ab["A"], ab["B"], arch, rank, where))
    return out


def _split_experts(prefix: str, a: torch.Tensor, b: torch.Tensor, arch, rank: int,
                   where: str) -> dict[str, torch.Tensor]:
    e, ffn, hidden = arch.num_experts, arch.moe_ffn_hidden_size, arch.hidden_size
    r_ = a.shape[0] // e
    if a.shape[0] % e or b.shape[1] != a.shape[0]:
        raise ValueError(f"PEFT tensors {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a fused "
                         f"LoRA of {e} experts")
    per_a = a.reshape(e, r_, a.shape[1])                       # [E, r', in]
    per_b = b.reshape(b.shape[0], r_, e).permute(2, 0, 1)      # [E, out, r']
    if (a.shape[1], b.shape[0]) == (ffn, hidden):              # down_proj
        if r_ != rank:
            raise ValueError(f"PEFT tensors {where} (down_proj): rank {r_}, our LoRA has rank {rank}")
        return {f"{prefix}.{x}.down_proj.lora_{ab}.weight": t[x].contiguous()
                for x in range(e) for ab, t in (("A", per_a), ("B", per_b))}
    if (a.shape[1], b.shape[0]) != (hidden, 2 * ffn):
        raise ValueError(f"PEFT tensors {where}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} fit neither "
                         f"gate_up_proj ({hidden} -> {2 * ffn}) nor down_proj ({ffn} -> {hidden}) of {e} experts")
    if r_ not in (rank, 2 * rank):
        raise ValueError(f"PEFT tensors {where} (gate_up_proj): rank {r_}, our LoRA has rank {rank} (or 2x{rank} "
                         "with equal halves)")
    if r_ == 2 * rank:
        if not torch.equal(per_a[:, :rank], per_a[:, rank:]):
            raise ValueError(f"PEFT tensor {where} (gate_up_proj, rank {r_}): its two halves of lora_A differ, our "
                             f"LoRA shares one A [{rank}, {hidden}] between an expert's gate and up (Megatron's "
                             "linear_fc1): not representable")
        per_a, per_b = per_a[:, :rank], per_b[..., :rank] + per_b[..., rank:]
    out = {}
    for x in range(e):
        for part, rows in (("gate_proj", slice(0, ffn)), ("up_proj", slice(ffn, 2 * ffn))):   # gate first
            out[f"{prefix}.{x}.{part}.lora_A.weight"] = per_a[x].contiguous()
            out[f"{prefix}.{x}.{part}.lora_B.weight"] = per_b[x, rows].contiguous()
    return out


def load_adapter_dir(model, arch, path, lora_cfg, model_path=None) -> int:
    """check_adapter_path, then this rank's slice of every factor copied in (import_peft.load_peft; collective
    when distributed). Returns the number of local factors set."""
    from .import_peft import load_peft

    check_adapter_path(path, lora_cfg, model_path)
    return load_peft(model, arch, read_peft_dir(path, arch, lora_cfg.rank))
