"""R3 check driver.

    rollout (vLLM bf16 with route capture, or HF transformers bf16 as a stand-in): tokens, routes, logprobs
    -> forced sets per sample, cut to lengths that differ between samples (so padded batches have padding):
       rollout (the engine's routes), random (valid random routes: most are ones the fp32 router would not pick),
       shuffled (the rollout routes permuted across tokens: the negative control)
    -> reference: HF transformers forced to the rollout and random sets (forced_routes.py, no alignment code)
    -> Megatron at each layout (replay_worker.py): replays every set padded and packed, compares logits with the
       reference, and checks the routing map its token dispatcher receives against the rollout-format routes.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..megatron.layout import Layout
from ..megatron.run_config import RunConfig
from .forced_routes import reference_model
from .torchrun import run_torchrun, worker_arg
from .layouts import check_layouts, group_by_world

MIN_SAMPLES = 8


def batch_size(layouts: list[Layout], world: dict[str, int] | None = None) -> int:
    """Samples in the rollout: at least MIN_SAMPLES and a multiple of every layout's data-parallel size at the world
    size it runs at (default: its smallest)."""
    dps = [(world or {}).get(l.name, l.min_world_size) // (l.tp * l.pp) for l in layouts]
    step = math.lcm(*dps)
    return step * math.ceil(MIN_SAMPLES / step)


def check_inputs(models: list[str], layouts: str, seq_len: int) -> list[Layout]:
    """Everything that can be refused before a process starts."""
    parsed = check_layouts(models, layouts)
    for l in parsed:
        if l.tp > 1 and seq_len % l.tp:
            raise ValueError(f"layout {l.name}: sequence length {seq_len} does not split over tp={l.tp} "
                             "sequence-parallel ranks")
    return parsed


def fidelity_lengths(n: int, seq_len: int, layouts: list[Layout]) -> list[int]:
    """Per-sample lengths for the fidelity sets: different per sample, each a multiple of every TP size (so a packed
    batch splits over sequence-parallel ranks)."""
    step = max(2, math.lcm(*[l.tp for l in layouts]))
    return [seq_len - step * (i % 4) for i in range(n)]


def make_rollout(models: list[str], out: Path, n: int = 8, s: int = 64, seed: int = 3) -> None:
    import transformers

    from .hf_routes import hf_rollout_routes

    data = {}
    for m in models:
        hf = transformers.AutoModelForCausalLM.from_pretrained(m, dtype=torch.bfloat16).eval()
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, hf.config.vocab_size, (n, s), generator=g)
        routes, lps = hf_rollout_routes(hf, list(tokens))
        data[m] = {"tokens": tokens, "routes": routes.to_field(), "num_experts": routes.num_experts,
                   "logprobs": lps, "bytes_per_token": routes.bytes_per_token}
    torch.save(data, out / "rollout.pt")


def make_rollout_vllm(models: list[str], out: Path, n: int = 8, overhead_batches: int = 0,
                      adapter_modes: str = "") -> None:
    import subprocess
    import sys

    from .torchrun import worker_env

    args = [sys.executable, "-m", "moe_lora_rl.checks.rollout_vllm_worker", "--models", ",".join(models),
            "--out", str(out / "rollout.pt"), "--n", str(n), "--overhead-batches", str(overhead_batches),
            "--adapter-modes", adapter_modes]
    proc = subprocess.run(args, env=worker_env(), cwd=out, capture_output=True, text=True, timeout=2400)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM rollout worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def pack_offsets(lengths: list[int], dp: int) -> list[int]:
    """Where each sample starts in its data-parallel rank's packed sequence (ranks take contiguous chunks)."""
    chunk = len(lengths) // dp
    return [sum(lengths[i - i % chunk:i]) for i in range(len(lengths))]


def check_rollout(d: dict, model: str) -> None:
    """The rollout's routes must fit the model (MoE layers, experts, top-k, one row per token): ValueError naming the
    value, before any process starts."""
    from ..models.arch import load_arch

    arch = load_arch(model)
    field = d["routes"]
    layers = tuple(field["routed_experts_layers"].tolist())
    want = tuple(i for i, moe in enumerate(arch.moe_layers) if moe)
    if layers != want:
        raise ValueError(f"{model}: routes for layers {layers}, the model's MoE layers are {want}")
    if d["num_experts"] != arch.num_experts:
        raise ValueError(f"{model}: routes over {d['num_experts']} experts, the model has {arch.num_experts}")
    if field["routed_experts"].shape[-1] != arch.topk:
        raise ValueError(f"{model}: routes with top-k {field['routed_experts'].shape[-1]}, the model's is {arch.topk}")
    lens, n = field["routed_experts_len"].tolist(), d["tokens"].shape[1]
    if any(L != n for L in lens):
        raise ValueError(f"{model}: routes cover {lens} tokens per sample, the samples have {n}")


def add_forced_sets(rollout: Path, out: Path, layouts: list[Layout], dp_sizes: list[int],
                    dtype: torch.dtype = torch.float32, seed: int = 5, adapter_stats: dict | None = None,
                    adapter_dp_sizes: list[int] | None = None) -> dict:
    """Forced sets and their reference logits (see the module docstring): reference[set][i] for padded batches,
    reference_packed[dp][set][i] for a sample packed behind the others of its data-parallel rank. Returns per model
    the forced decisions the reference's own routers would not pick, per set. Rollouts with an adapter served get
    their sets too (_adapter_sets, packed references for adapter_dp_sizes (default dp_sizes); their statistics go
    to adapter_stats[model])."""
    data = torch.load(rollout)
    stats = {}
    for m, d in data.items():
        check_rollout(d, m)
        hf = reference_model(m, dtype)
        n, s = d["tokens"].shape
        lengths = fidelity_lengths(n, s, layouts)
        g = np.random.default_rng(seed)
        full = _samples(d["routes"])
        k, e = full[0].shape[2], d["num_experts"]
        sets = {"rollout": [r[:L] for r, L in zip(full, lengths)],
                "random": [np.argsort(g.random((L, r.shape[1], e)), axis=-1)[..., :k] for r, L in zip(full, lengths)]}
        sets["shuffled"] = [r[g.permutation(L)] for r, L in zip(sets["rollout"], lengths)]
        ref, packed, differ = _references(hf, d["tokens"], sets, ("rollout", "random"), lengths, dp_sizes)
        d.update(lengths=lengths, forced_sets=sets, reference=ref, reference_packed=packed)
        stats[m] = differ
        del hf
        if "adapter" in d:
            ad = _adapter_sets(m, d, lengths, dp_sizes if adapter_dp_sizes is None else adapter_dp_sizes, dtype, g)
            if adapter_stats is not None:
                adapter_stats[m] = ad
    torch.save(data, out)
    return stats


def _samples(field) -> list[np.ndarray]:
    return [field["routed_experts"][i, :n].numpy().astype(np.int64)
            for i, n in enumerate(field["routed_experts_len"].tolist())]


def _references(hf, tokens, sets, names, lengths, dp_sizes):
    """HF forced to each named set: padded references, packed ones per data-parallel size, and per set the forced
    decisions the reference's own routers would not pick (the rollout's last row is padding: not counted)."""
    from .forced_routes import differ_fraction, forced_logits

    s = tokens.shape[1]
    ref, packed, differ = {}, {dp: {} for dp in dp_sizes}, {}
    for name in names:
        ref[name], bad, tot = [], 0, 0
        for i, (r, L) in enumerate(zip(sets[name], lengths)):
            logits, own = forced_logits(hf, tokens[i, :L], r)
            ref[name].append(logits)
            rows = min(L, s - 1) if name == "rollout" else L
            b, t = differ_fraction(r[:rows], own[:rows])
            bad, tot = bad + b, tot + t
        differ[name] = (bad, tot)
        for dp in dp_sizes:
            offs = pack_offsets(lengths, dp)
            packed[dp][name] = [forced_logits(hf, tokens[i, :L], r, offs[i])[0] if offs[i] else ref[name][i]
                                for i, (r, L) in enumerate(zip(sets[name], lengths))]
    return ref, packed, differ


def _adapter_sets(m: str, d: dict, lengths, dp_sizes, dtype, g) -> dict:
    """Rollouts captured while vLLM served an expert adapter (rollout_vllm_worker --adapter-modes): per serving mode
    the rollout and shuffled sets, and the reference of HF with the same adapter merged forced to the rollout set.
    Returns per mode the forced decisions the adapted reference's routers would not pick, and how many of the
    rollout's decisions differ from the base model's routers' own on the same tokens (the adapter moved them)."""
    from ..models.arch import load_arch
    from .forced_routes import differ_fraction, forced_logits
    from .route_reference import merged_hf_model, random_expert_adapter

    ad = d["adapter"]
    peft = random_expert_adapter(load_arch(m), ad["rank"], seed=ad["seed"], fused_fc1=True)
    hf = merged_hf_model(m, peft, ad["alpha"] / ad["rank"], dtype, experts_implementation="eager")
    base = reference_model(m, dtype)
    stats = {}
    for mode, x in ad["modes"].items():
        full = _samples(x["routes"])
        sets = {"rollout": [r[:L] for r, L in zip(full, lengths)]}
        sets["shuffled"] = [r[g.permutation(L)] for r, L in zip(sets["rollout"], lengths)]
        ref, packed, differ = _references(hf, x["tokens"], sets, ("rollout",), lengths, dp_sizes)
        moved = [differ_fraction(r[:-1], forced_logits(base, x["tokens"][i, :L], r)[1][:-1])
                 for i, (r, L) in enumerate(zip(sets["rollout"], lengths))]
        x.update(lengths=lengths, forced_sets=sets, reference=ref, reference_packed=packed)
        stats[mode] = {"adapted_router_differs": differ["rollout"],
                       "base_router_differs": tuple(map(sum, zip(*moved)))}
    return stats


def run(models: list[str], layouts: str, workdir: Path, engine: str = "hf", overhead_batches: int = 0,
        timing: int = 0, single_launch: bool = False, dtype: torch.dtype = torch.float32,
        rc: RunConfig | None = None, adapter_modes: str = "", adapter_layouts: str = "") -> dict:
    """engine: "vllm" (bf16 rollouts with routing capture) or "hf" (HF transformers bf16 stand-in).
    single_launch: every layout in one torchrun launch at the largest world size (tests: fewer launches).
    dtype: the forced-route reference's; rc: how Megatron runs (default fp32 on CPU).
    adapter_modes (vllm only, e.g. "unmerged,merged"): also roll out while the engine serves an expert adapter in
    each serving mode; Megatron with the same adapter in its LoRA replays those routes at adapter_layouts (a subset
    of layouts) against HF with the adapter merged (result["adapter"][layout][model][mode])."""
    if engine not in ("vllm", "hf"):
        raise ValueError(f"engine={engine!r}; choose 'vllm' or 'hf'")
    if adapter_modes and engine != "vllm":
        raise ValueError("adapter_modes needs engine='vllm' (routes captured while vLLM serves the adapter)")
    bad = sorted(set(filter(None, adapter_modes.split(","))) - {"unmerged", "merged"})
    if bad:
        raise ValueError(f"adapter_modes: unknown serving modes {bad}; choose from unmerged, merged")
    if bool(adapter_modes) != bool(adapter_layouts):
        raise ValueError("adapter_modes and adapter_layouts go together")
    extra = sorted(set(filter(None, adapter_layouts.split(","))) - set(layouts.split(",")))
    if extra:
        raise ValueError(f"adapter_layouts {extra} are not among the layouts {layouts}")
    seq_len = 64
    parsed = check_inputs(models, layouts, seq_len)
    groups = group_by_world(layouts)
    if single_launch:
        world = math.lcm(*groups)
        for l in parsed:
            l.check_world_size(world)
        groups = {world: [n for names in groups.values() for n in names]}
    at = {name: w for w, names in groups.items() for name in names}
    n = batch_size(parsed, {Layout.parse(k).name: v for k, v in at.items()})
    workdir.mkdir(parents=True, exist_ok=True)
    if not (workdir / "rollout.pt").exists():                 # a test module reuses one rollout
        if engine == "vllm":
            make_rollout_vllm(models, workdir, n, overhead_batches, adapter_modes)
        else:
            make_rollout(models, workdir, n, seq_len)
    dp_sizes = sorted({at[l] // (Layout.parse(l).tp * Layout.parse(l).pp) for l in at})
    adapter_stats: dict = {}
    adapter_dp = sorted({at[l] // (Layout.parse(l).tp * Layout.parse(l).pp)
                         for l in at if l in adapter_layouts.split(",")})
    differ = add_forced_sets(workdir / "rollout.pt", workdir / "forced.pt", parsed, dp_sizes, dtype,
                             adapter_stats=adapter_stats, adapter_dp_sizes=adapter_dp)
    res: dict = {"forced_decisions": differ}
    if adapter_stats:
        res["adapter_routes"] = adapter_stats
    for world, names in groups.items():
        here = [l for l in filter(None, adapter_layouts.split(",")) if l in names]
        got = run_torchrun("moe_lora_rl.checks.replay_worker", world,
                           ["--models", ",".join(models), "--layouts", ",".join(names),
                            "--data", str(workdir / "forced.pt"), "--timing", str(timing),
                            "--adapter-layouts", ",".join(here), *worker_arg(rc or RunConfig())], timeout=1800)
        res.setdefault("adapter", {}).update(got.pop("adapter", {}))
        res.update(got)
    return res
