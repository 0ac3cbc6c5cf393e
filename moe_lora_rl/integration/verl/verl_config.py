"""What our overrides read from verl's config, and the start-up checks that refuse conflicting options.

    actor_rollout_ref.actor.megatron._target_=moe_lora_rl.integration.verl.plugin.MoELoRAEngineConfig
    actor_rollout_ref.model.external_lib=moe_lora_rl.integration.verl.plugin
    actor_rollout_ref.model.lora.{rank,alpha,dropout,targets,adapter_layout} (verl's target_modules: see lora_targets)
    actor_rollout_ref.rollout.name=moe_lora_vllm

`MoELoRAEngineConfig` is verl's McoreEngineConfig (the same parallel sizes, `router_replay.mode`, micro-batching)
naming our backend; it accepts float32 as well as bfloat16 (verl's own asserts bf16/fp16). Every error here is a
ValueError naming the config key and the offending value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl.workers.config import McoreEngineConfig
from verl.workers.config.engine import EngineConfig

from ...lora.config import ALIASES, GROUPS, TARGETS, LoRAConfig
from ...megatron.layout import Layout
from ...megatron.run_config import RunConfig
from . import keys

BACKEND = "moe_lora"
REPLICA = "moe_lora_vllm"
PACKAGE = "moe_lora_rl.integration.verl"
PLUGIN = f"{PACKAGE}.plugin"                 # the composition root: verl imports it, it registers
ENGINE_TARGET = f"{PLUGIN}.MoELoRAEngineConfig"
SUPPORTED_VERL = ("0.9",)
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
LORA = "actor_rollout_ref.model.lora"
def check_verl_version(version: str | None = None) -> None:
    import verl

    v = version or verl.__version__
    if not v.startswith(SUPPORTED_VERL):
        raise ValueError(f"verl version {v!r} is not supported by {PACKAGE} (supported: {', '.join(SUPPORTED_VERL)}.x)")


def engine_layout(tp: int, ep: int, etp: int | None, pp: int) -> Layout:
    """verl's actor.megatron sizes as our Layout; expert_tensor_parallel_size unset (None) follows megatron-core's
    default, ETP = TP (parallel_state.initialize_model_parallel)."""
    return Layout(tp=tp, ep=ep, etp=tp if etp is None else etp, pp=pp)


def megatron_overrides(override, layout: Layout, rc: RunConfig) -> dict:
    """actor.megatron.override_transformer_config read into our model builder's arguments
    (megatron/moe_options.transformer_overrides), its one-line refusals prefixed with the key's path."""
    from ...megatron.moe_options import transformer_overrides

    try:
        return transformer_overrides(override or {}, layout, rc)
    except ValueError as e:
        raise ValueError(f"actor_rollout_ref.actor.megatron.{e}") from None


@dataclass
class MoELoRAEngineConfig(McoreEngineConfig):
    """verl's Megatron engine config, selecting our engine (strategy moe_lora) and allowing fp32 on CPU."""

    strategy: str = BACKEND
    dtype: str = "bfloat16"
    device: str = "cuda"
    """cuda, or cpu (gloo; for tests and small runs)."""
    r3_check_log: str = ""
    """A JSON-lines file: with R3 on, each log-prob recompute that carries the rollout's log-probs is also run without
    replay, and the token-mean k3 KL of both against the rollout is appended (r3_check.py). Empty: off."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)         # McoreEngineConfig's own checks assert strategy megatron and bf16
        if self.strategy != BACKEND:
            raise ValueError(f"actor_rollout_ref.actor.megatron.strategy={self.strategy!r}: our engine config is "
                             f"selected by _target_ and must keep strategy {BACKEND!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"actor_rollout_ref.actor.megatron.dtype={self.dtype!r}: choose one of {tuple(DTYPES)}")
        for key in ("virtual_pipeline_model_parallel_size",):
            if getattr(self, key) not in (None, 1):
                raise ValueError(f"actor_rollout_ref.actor.megatron.{key}={getattr(self, key)!r} is not supported")
        if self.context_parallel_size != 1:
            raise ValueError(f"actor_rollout_ref.actor.megatron.context_parallel_size={self.context_parallel_size} "
                             "is not supported (1 only)")
        if self.router_replay.mode not in ("disabled", "R3"):
            raise ValueError(f"actor_rollout_ref.actor.megatron.router_replay.mode={self.router_replay.mode!r}: "
                             "choose disabled or R3")
        if self.tensor_model_parallel_size == 1:
            object.__setattr__(self, "sequence_parallel", False)
        self.layout()
        self.run_config()
        self.transformer_overrides()

    def transformer_overrides(self) -> dict:
        """override_transformer_config read into our model builder's arguments (megatron/moe_options.py): each
        megatron-core option honoured or refused in one line."""
        return megatron_overrides(self.override_transformer_config, self.layout(), self.run_config())

    def layout(self) -> Layout:
        return engine_layout(self.tensor_model_parallel_size, self.expert_model_parallel_size,
                             self.expert_tensor_parallel_size, self.pipeline_model_parallel_size)

    def run_config(self) -> RunConfig:
        try:
            return RunConfig(device=self.device, dtype=DTYPES[self.dtype])
        except ValueError as e:
            raise ValueError(f"actor_rollout_ref.actor.megatron.device={self.device!r}: {e}") from None


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


# verl's default target_modules (hf_model.yaml): "every linear" of a GQA model, read as our "all"
VERL_DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_targets(lora: Mapping) -> tuple[str, ...]:
    """Our target names from model.lora: `targets` (ours), or verl's `target_modules` (Megatron module names such as
    linear_q_down_proj, or our target/group names; "all-linear" and verl's default list mean every linear the model
    has). ValueError, naming the key, for both set differently, a name we do not know (wildcards and layer-selective
    patterns included), or a non-empty exclude_modules (not supported)."""
    exclude = lora.get("exclude_modules")
    if exclude:
        raise ValueError(f"{LORA}.exclude_modules={list(exclude)!r} is not supported; name what to adapt in "
                         f"{LORA}.target_modules")
    ours = lora.get("targets")
    ours = None if ours is None else ((ours,) if isinstance(ours, str) else tuple(ours))
    modules = lora.get("target_modules")
    modules = None if modules is None else ((modules,) if isinstance(modules, str) else tuple(modules))
    if modules in (("all-linear",), VERL_DEFAULT_TARGET_MODULES):
        modules = None
    if modules is not None:
        known = set(TARGETS) | set(GROUPS) | set(ALIASES) | {"all"}
        bad = [m for m in modules if m not in known]
        if bad:
            raise ValueError(f"{LORA}.target_modules: {bad} are not module names we adapt (no wildcards or "
                             f"per-layer patterns); accepted: {sorted(ALIASES)}, our targets {sorted(TARGETS)} "
                             f"and groups {sorted(GROUPS)}, or 'all-linear'")
        if ours is not None and set(ours) != set(modules):
            raise ValueError(f"{LORA}.targets={list(ours)!r} and {LORA}.target_modules={list(modules)!r} disagree; "
                             "set one of them")
        return modules
    return ours or ("all",)


def lora_config(lora: Mapping | None) -> LoRAConfig:
    """Our LoRAConfig from verl's model.lora section; keys the key table does not know, and values it refuses, are
    one-line ValueErrors (keys.py)."""
    lora = dict(lora or {})
    for key, value in lora.items():
        bad = keys.refusal(f"model.lora.{key}", value)
        if bad:
            raise ValueError(bad)
    rank = lora.get("rank", 0)
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"{LORA}.rank={rank!r}: our engine trains LoRA adapters only, set a positive rank")
    targets = lora_targets(lora)
    try:
        return LoRAConfig(rank=rank, alpha=float(lora.get("alpha", 2 * rank)), dropout=float(lora.get("dropout", 0.0)),
                          targets=targets, adapter_layout=lora.get("adapter_layout", "per_expert"),
                          init_seed=int(lora.get("init_seed", 0)),
                          a_init=lora.get("lora_A_init_method") or "kaiming")
    except ValueError as e:
        raise ValueError(f"{LORA}: {e}") from None


SECTIONS = ("model", "actor", "ref", "rollout")


def _leaves(node, prefix: str):
    """(path, value) for every leaf of a plain nested dict (an empty dict is a leaf)."""
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}")
    else:
        yield prefix, node


def engine_sections(cfg) -> dict:
    """actor_rollout_ref's model / actor / ref / rollout sections as plain dicts, interpolations resolved."""
    arr = _get(cfg, "actor_rollout_ref")
    out = {}
    for sec in SECTIONS:
        node = _get(arr, sec)
        if node is None:
            continue
        try:
            from omegaconf import OmegaConf

            node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except ImportError:
            pass
        out[sec] = node
    return out


def key_refusals(sections: dict) -> list[str]:
    """Every refusal of the key table (keys.py) over engine_sections' leaves: an unknown key, a value we do not
    honour, a ref.megatron value that differs from the actor's; one line each."""
    actor_megatron = dict(_leaves(sections.get("actor", {}).get("megatron", {}), "megatron"))
    out = []
    for sec, node in sections.items():
        for path, value in _leaves(node, sec):
            other = actor_megatron.get(path[len("ref."):]) if path.startswith("ref.megatron.") else None
            bad = keys.refusal(path, value, other)
            if bad:
                out.append(bad)
    return out


def check_keys(sections: dict) -> None:
    """The first refusal of key_refusals as a one-line ValueError naming the key and what to do."""
    bad = key_refusals(sections)
    if bad:
        raise ValueError(bad[0])


def check_trainer(cfg) -> None:
    """verl's V1 trainer (trainer.use_v1, verl 0.9.1's default) hard-codes verl's own worker classes and needs
    transfer_queue; our override runs in verl's V0 trainer and its async trainers: our config sets
    trainer.use_v1=false, and a config that sets it back is refused."""
    trainer = _get(cfg, "trainer")
    if trainer is not None and _get(trainer, "use_v1", False):
        raise ValueError("trainer.use_v1=True: our override runs in verl's V0 trainer (V1 hard-codes verl's workers); "
                         "set trainer.use_v1=false (our recipe config does)")


def check_reward_manager(cfg) -> None:
    """verl's plain naive reward manager passes a NaN reward on to the advantages (a skipped step, silently): ours is
    the same manager with non-finite rewards refused (reward_manager.py). Another manager the user named is theirs."""
    legacy = _get(cfg, "reward_model")
    for key in ("reward_manager", "reward_loop_source"):
        if _get(legacy, key) is not None:
            raise ValueError(f"reward_model.{key}={_get(legacy, key)!r}: verl's legacy key replaces "
                             "reward.reward_manager (ours refuses NaN rewards); remove it")
    rm = _get(_get(cfg, "reward"), "reward_manager")
    if rm is not None and _get(rm, "source", "register") == "register" and _get(rm, "name", "naive") == "naive":
        raise ValueError("reward.reward_manager.name=naive passes NaN rewards into the advantages (the step is then "
                         "skipped silently): set reward.reward_manager.source=importlib "
                         "reward.reward_manager.name=FiniteRewardManager reward.reward_manager.module.path="
                         "pkg://moe_lora_rl.integration.verl.reward_manager (our config does)")


def check_config(cfg) -> None:
    """Start-up checks on the whole (composed) verl config: the trainer version, every engine key (keys.py), our
    engine, external_lib, LoRA, rollout, routes."""
    check_verl_version()
    check_trainer(cfg)
    check_reward_manager(cfg)
    sections = engine_sections(cfg)
    check_keys(sections)
    arr = _get(cfg, "actor_rollout_ref")
    model, actor, rollout = _get(arr, "model"), _get(arr, "actor"), _get(arr, "rollout")
    target = _get(_get(actor, "megatron"), "_target_")
    if target != ENGINE_TARGET:
        raise ValueError(f"actor_rollout_ref.actor.megatron._target_={target!r}: set it to {ENGINE_TARGET}")
    ext = _get(model, "external_lib")
    libs = [ext] if isinstance(ext, str) else list(ext or [])
    if PLUGIN not in libs:
        raise ValueError(f"actor_rollout_ref.model.external_lib={ext!r}: set it to {PLUGIN} (it registers our "
                         "engine and rollout in verl's workers)")
    lora = lora_config(_get(model, "lora"))
    adapter_path = _get(_get(model, "lora"), "adapter_path")
    if adapter_path:
        import os

        from ...refit.peft_dir import check_adapter_path

        path = os.path.expanduser(str(_get(model, "path") or ""))
        check_adapter_path(adapter_path, lora, path if os.path.isdir(path) else None)
    from .lr_schedule import check_lr_schedule

    check_lr_schedule(_get(actor, "optim"))
    if _get(model, "lora_rank", 0):
        raise ValueError(f"actor_rollout_ref.model.lora_rank={_get(model, 'lora_rank')!r} is verl's FSDP LoRA; "
                         f"use {LORA}.rank")
    name = _get(rollout, "name")
    if name != REPLICA:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: set it to {REPLICA} (our vLLM replica: expert "
                         "LoRA refit and route capture)")
    from ...vllm.compat import check_vllm_version

    check_vllm_version(f"actor_rollout_ref.rollout.name={REPLICA}")
    check_engine(sections.get("actor", {}).get("megatron", {}))
    check_rollout(rollout, _get(_get(actor, "megatron"), "router_replay"))
    check_loss(actor)


def check_engine(megatron: Mapping) -> None:
    """The engine config's layout and override_transformer_config checks before Ray starts, on the composed and
    resolved actor.megatron section (what verl's workers will instantiate)."""
    layout = engine_layout(megatron.get("tensor_model_parallel_size", 1), megatron.get("expert_model_parallel_size", 1),
                           megatron.get("expert_tensor_parallel_size"), megatron.get("pipeline_model_parallel_size", 1))
    megatron_overrides(megatron.get("override_transformer_config"), layout,
                       RunConfig(device=megatron.get("device", "cuda"), dtype=DTYPES.get(megatron.get("dtype"), "bf16")))


def check_loss(actor) -> None:
    """verl's seq-mean-token-sum-norm divides by actor.loss_scale_factor, or when it is null by the padded width of
    each micro-batch's tensor (core_algos.agg_loss): a scale that moves with padding and prompt lengths. Refused
    unless the factor is set (a constant of the run: data.max_response_length, Dr. GRPO's constant)."""
    mode = _get(actor, "loss_agg_mode", "token-mean")
    if mode == "seq-mean-token-sum-norm" and _get(actor, "loss_scale_factor") is None:
        raise ValueError("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm needs "
                         "actor_rollout_ref.actor.loss_scale_factor (null divides by the padded width of each batch): "
                         "set it to data.max_response_length")


WORKER_EXTENSION = "moe_lora_rl.integration.verl.vllm_extension.VerlMoELoRAWorkerExtension"


def rollout_load_format(rollout) -> str:
    """verl starts vLLM on dummy weights and relies on the first sync for the base. Colocated ("naive") syncs carry
    the base once (our worker extension loads it), and so does our "moe_lora_base" checkpoint-engine backend (vLLM's
    weight-transfer calls); our "moe_lora" backend carries adapters only, so there vLLM loads the base from the
    checkpoint itself (it never trains)."""
    fmt = _get(rollout, "load_format", "dummy")
    backend = _get(_get(rollout, "checkpoint_engine"), "backend", "naive")
    return "auto" if fmt == "dummy" and backend not in ("naive", "moe_lora_base") else fmt


def check_rollout(rollout, router_replay=None) -> None:
    """vLLM's own LoRA must stay off (our worker extension serves the adapters); R3 needs the rollout's routes."""
    vkw = _get(_get(rollout, "engine_kwargs"), "vllm") or {}
    for key in ("enable_lora", "fully_sharded_loras", "max_loras", "max_lora_rank"):
        if _get(vkw, key) not in (None, False):
            raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={_get(vkw, key)!r} turns on vLLM's "
                             "own LoRA, which our worker extension replaces: remove it")
    ext = _get(vkw, "worker_extension_cls")
    if ext not in (None, WORKER_EXTENSION):
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={ext!r}: our replica "
                         "sets its own worker extension, remove it")
    mode = _get(router_replay, "mode", "disabled")
    replay = bool(_get(rollout, "enable_rollout_routing_replay", False))
    if _get(vkw, "enable_return_routed_experts") not in (None, False):
        raise ValueError("actor_rollout_ref.rollout.engine_kwargs.vllm.enable_return_routed_experts="
                         f"{_get(vkw, 'enable_return_routed_experts')!r} turns on vLLM's own routes next to ours "
                         f"(actor_rollout_ref.rollout.enable_rollout_routing_replay={replay}): remove it, our replica "
                         "captures the routes")
    if mode == "R3" and not replay:
        raise ValueError("actor_rollout_ref.actor.megatron.router_replay.mode='R3' needs "
                         "actor_rollout_ref.rollout.enable_rollout_routing_replay=True (got False)")
