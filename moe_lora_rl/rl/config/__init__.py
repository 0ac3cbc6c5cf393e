"""The training run's configuration: one dataclass per concern, validated in __post_init__ (ValueError naming the
value), composed by hydra from recipes/train.yaml with strict keys (see ``load``).

    load(["layout.tp=2", "lora.rank=16", "replay=r2"]) -> TrainConfig

The package: TrainConfig, AlgoSettings and load here; the sections in model_settings.py (model, layout, runtime,
LoRA), rollout_settings.py (rollout engines, delays, and the value checks every section uses), data_settings.py
(data, reward; their values checked against data/'s task, prompting and reader) and policy_settings.py (the
`policies` list). Checks that need the model or the world size (does the layout divide the experts, does the model
have MoE layers for replay, the tokenizer against the prompts) are preflight.py's, run before any process group
starts; everything checkable from the config alone is checked here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

from ...algos import LOSS_AGG_MODES, LOSS_MODES, PolicyLossSettings
from ...rollout.expert_precision import check_expert_precision
from .model_settings import LayoutSettings, LoRASettings, ModelSettings, RuntimeSettings
from .policy_settings import PolicySettings, check_policies, policy_config
from .data_settings import DataSettings, RewardSettings
from .rollout_settings import DelaySettings, RolloutSettings
from .rollout_settings import _choice, _positive

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
REPLAY_MODES = ("r3", "r2", "off")
SERVING_MODES = ("unmerged", "merged")
ROLLOUT_IS = ("token", "sequence", "mis", "sparse", "off")
MODES = ("sync", "async")
INFLIGHT = ("switch", "pin")
TAKE_ORDER = ("finish", "admission")
POLICIES_ROLLOUT = ("turns", "batched")


@dataclass
class AlgoSettings:
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    prompts_per_step: int = 8
    """Prompts per step; the global batch is prompts_per_step * group_size responses."""
    micro_batch_size: int = 16
    """Responses per microbatch of the update."""
    mini_batches: int = 1
    """PPO mini-batches per rollout batch (verl's ppo_mini_batch_size = batch / mini_batches): the batch is cut into
    this many contiguous slices, one optimizer step each, every step against the same old logprobs (the trainer's
    replayed recompute before the first; rl/trainer_step.py). 1: one step per rollout batch."""
    epochs: int = 1
    """PPO epochs (verl's ppo_epochs): passes over the mini-batches per rollout batch; the adapter version advances
    by mini_batches * epochs optimizer steps per push."""
    lr: float = 1e-3
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    max_response_tokens: int = 8
    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    norm_adv_by_std: bool = True
    kl_coef: float = 0.0
    """KL to the reference policy (the adapters disabled); 0 turns the reference pass off."""
    rollout_is: str = "token"
    """Rollout correction on the behaviour ratio (training's replayed logprobs before the update / the engine's):
    token or sequence truncated importance sampling (min(ratio, threshold)), mis (masked importance sampling: tokens
    whose ratio leaves [1/threshold, threshold] are left out of the loss), sparse (Sparse-RL's rejection and
    reweighting, algo.sparse_*: for rollouts on a compressed KV cache) or off."""
    rollout_is_threshold: float = 2.0
    sparse_veto: float = 1e-4
    """rollout_is=sparse (Sparse-RL, for rollout.kv_compression): a sequence with any token whose consistency ratio
    pi_dense / pi_sparse is below this is rejected whole."""
    sparse_lower: float = 0.5
    """rollout_is=sparse: tokens whose ratio lies outside [sparse_lower, sparse_upper] leave the loss."""
    sparse_upper: float = 1.5
    """rollout_is=sparse: also the truncation of the kept tokens' weights min(ratio, sparse_upper), normalised to
    mean 1 over the batch."""

    def __post_init__(self):
        for k in ("group_size", "prompts_per_step", "micro_batch_size", "mini_batches", "epochs",
                  "max_response_tokens"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"algo.{k}={v!r} must be an integer >= 1")
        if self.group_size < 2:
            raise ValueError(f"algo.group_size={self.group_size} must be >= 2 (GRPO compares samples of a prompt)")
        batch = self.group_size * self.prompts_per_step
        if batch % self.micro_batch_size:
            raise ValueError(f"algo.micro_batch_size={self.micro_batch_size} does not divide the batch "
                             f"group_size*prompts_per_step={batch}")
        if batch % self.mini_batches:
            raise ValueError(f"algo.mini_batches={self.mini_batches} does not divide the batch "
                             f"group_size*prompts_per_step={batch}")
        if (batch // self.mini_batches) % self.micro_batch_size:
            raise ValueError(f"algo.micro_batch_size={self.micro_batch_size} does not divide a mini-batch of "
                             f"{batch // self.mini_batches} responses (batch {batch} / mini_batches="
                             f"{self.mini_batches})")
        _positive("algo.lr", self.lr, zero_ok=True)           # lr=0 is the control run
        _positive("algo.weight_decay", self.weight_decay, zero_ok=True)
        _positive("algo.grad_clip", self.grad_clip)
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"algo.betas={list(self.betas)!r}: need two values in [0, 1)")
        _positive("algo.temperature", self.temperature)
        _positive("algo.kl_coef", self.kl_coef, zero_ok=True)
        _choice("algo.loss_mode", self.loss_mode, LOSS_MODES)
        _choice("algo.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _choice("algo.rollout_is", self.rollout_is, ROLLOUT_IS)
        if not 0 < self.clip_ratio_low < 1 or not self.clip_ratio_high > 0:
            raise ValueError(f"algo.clip_ratio_low={self.clip_ratio_low}, clip_ratio_high={self.clip_ratio_high}: "
                             "need 0 < low < 1 and high > 0")
        if not self.rollout_is_threshold > 1:
            raise ValueError(f"algo.rollout_is_threshold={self.rollout_is_threshold} must be > 1")
        self.policy_loss_settings()
        self.sparse_settings()

    def sparse_settings(self):
        from ...algos import SparseCorrection

        try:
            return SparseCorrection(veto=self.sparse_veto, lower=self.sparse_lower, upper=self.sparse_upper)
        except ValueError as e:
            raise ValueError(f"algo.sparse_*: {e}") from None

    def policy_loss_settings(self) -> PolicyLossSettings:
        """loss_scale_factor: the response budget, seq-mean-token-sum-norm's constant divisor (Dr. GRPO's; verl's
        key), whatever the batch's padding, prompt lengths, micro-batches, data-parallel split or mini-batches."""
        return PolicyLossSettings(loss_mode=self.loss_mode, clip_ratio_low=self.clip_ratio_low,
                                  clip_ratio_high=self.clip_ratio_high, loss_agg_mode=self.loss_agg_mode,
                                  loss_scale_factor=self.max_response_tokens)


@dataclass
class TrainConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    layout: LayoutSettings = field(default_factory=LayoutSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    lora: LoRASettings = field(default_factory=LoRASettings)
    data: DataSettings = field(default_factory=DataSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    algo: AlgoSettings = field(default_factory=AlgoSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    delay: DelaySettings = field(default_factory=DelaySettings)
    replay: str = "r3"
    """Router replay: r3 (rollout routes replayed in training), r2 (training's first pass recorded and replayed),
    off."""
    serving: str = "unmerged"
    """unmerged: vLLM serves base + LoRA, refit sends adapters only; merged: refit sends merged weights."""
    mode: str = "sync"
    """sync: rollout and training take turns; async: the engine keeps generating the next steps' groups while the
    trainer consumes finished ones, each update pushed in flight (rl/async_source.py)."""
    max_staleness: int = 1
    """mode=async: the most pushes a trained sample may lag (the pushes between the version of its oldest token and
    the trainer's version at its update: one per rollout batch, however many optimizer steps algo.mini_batches and
    algo.epochs make of it); the producer is held back to it and a group over it is dropped, never trained on."""
    inflight: str = "switch"
    """mode=async: how the engine takes a new version while generating: switch (every request moves to it at the
    next step, its tokens stamped per version) or pin (a request keeps the version it started with)."""
    take_order: str = "finish"
    """mode=async: which finished groups an update takes: finish (in finishing order: the trainer never waits while
    a group is ready, but the first updates see the shortest answers and a long group may be dropped as stale) or
    admission (the oldest admitted first: every answer length reaches the trainer in the proportion it is sampled,
    no group is ever over the bound, and finished short groups wait for the long ones admitted before them)."""
    keep_served: bool = False
    """Keep the adapters of the last max_staleness + 1 versions and write every trained sample with its token
    versions and routes to out_dir/served/ (rl/served.py), so training can be checked against what was served
    (either mode)."""
    steps: int = 80
    seed: int = 0
    eval_every: int = 10
    """Held-out evaluation every N steps (and at the start and the end); 0: only start and end."""
    checkpoint_every: int = 0
    """Checkpoint every N steps; 0: none."""
    free_routing_every: int = 1
    """With replay=r3: the trainer's recompute without replay (its own routing: the no-R3 KL, ratio and free router
    disagreement figures) every N steps; 0: never. A diagnostic pass: one forward of the batch, a fifth of a step's
    trainer time on the default model. replay=r2/off need that pass every step (it is their proximal policy)."""
    resume: Any = False
    """true: continue from the latest complete checkpoint in out_dir/checkpoints (the engines restart and get that
    version); auto: the same if a checkpoint exists, else start fresh (for torchrun --max-restarts / requeued slurm
    jobs: a restarted run continues by itself); false: start fresh."""
    engine_restarts: int = 2
    """If the rollout engine process dies, restart it (and repeat the interrupted rollout) up to this many times."""
    out_dir: str = "outputs/train"
    policies: List[PolicySettings] = field(default_factory=list)
    """Several policies trained together on one base and one engine pool (rl/config/policy_settings.py): each a name and
    the settings it changes (seed, lr, alpha, task, data files, max_staleness); empty: the one policy of this
    config."""
    policies_rollout: str = "turns"
    """With policies: turns (each policy's step generated while the previous policy trains) or batched (every
    policy's step generated in one engine batch, each request on its own policy's version, then each trains)."""

    def __post_init__(self):
        _choice("replay", self.replay, REPLAY_MODES)
        _choice("serving", self.serving, SERVING_MODES)
        check_expert_precision(self.rollout.expert_precision, self.serving, "rollout.expert_precision")
        _choice("mode", self.mode, MODES)
        _choice("inflight", self.inflight, INFLIGHT)
        _choice("take_order", self.take_order, TAKE_ORDER)
        if self.mode == "async":
            if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) \
                    or self.max_staleness < 1:
                raise ValueError(f"max_staleness={self.max_staleness!r}: mode=async needs an integer >= 1 (0 is "
                                 "the synchronous run: use mode=sync)")
            if self.inflight == "pin" and self.serving == "merged":
                raise ValueError("inflight=pin with serving=merged: a merged engine serves one version at a time; "
                                 "use serving=unmerged or inflight=switch")
            if self.inflight == "pin" and self.max_staleness + 1 > self.rollout.max_versions:
                raise ValueError(f"max_staleness={self.max_staleness} with inflight=pin needs the engine to hold "
                                 f"{self.max_staleness + 1} adapter versions; rollout.max_versions="
                                 f"{self.rollout.max_versions} (raise it or lower max_staleness)")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be an integer >= 1")
        for k in ("eval_every", "checkpoint_every", "free_routing_every", "seed", "engine_restarts"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{k}={v!r} must be an integer >= 0")
        if isinstance(self.resume, str) and self.resume.lower() in ("true", "false"):
            self.resume = self.resume.lower() == "true"
        if self.resume not in (True, False, "auto") or isinstance(self.resume, (int, float)) \
                and not isinstance(self.resume, bool):
            raise ValueError(f"resume={self.resume!r}; choose one of (true, false, 'auto')")
        _choice("policies_rollout", self.policies_rollout, POLICIES_ROLLOUT)
        check_policies(self.policies, rollout=self.rollout, mode=self.mode, inflight=self.inflight,
                       max_staleness=self.max_staleness)
        if self.resume and self.checkpoint_every == 0:
            raise ValueError(f"resume={str(self.resume).lower()} needs checkpoint_every > 0 (a run without "
                             "checkpoints cannot resume)")
        for p in self.policies:               # each policy's own run config is a valid one
            try:
                policy_config(self, p)
            except ValueError as e:
                raise ValueError(f"policies: {p.name!r}: {e}") from None


SCHEMA_NAME = "moe_lora_rl_train_schema"


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def _unknown_key(msg: str) -> str | None:
    import re

    m = re.search(r"Key '([^']+)' is not in struct", msg) or re.search(r"Could not override '([^']+)'", msg) \
        or re.search(r"Key '([^']+)' not in '([^']+)'", msg)
    return m.group(1) if m else None


def split_config_name(argv: list[str]) -> tuple[str, list[str]]:
    """hydra's `--config-name NAME` (or `--config-name=NAME`, `-cn NAME`) and the overrides; ValueError naming a recipe
    that recipes/ does not hold."""
    name, rest, args = "train", [], list(argv)
    while args:
        a = args.pop(0)
        if a in ("--config-name", "-cn"):
            if not args:
                raise ValueError(f"{a} needs a recipe name")
            name = args.pop(0)
        elif a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
    if not (RECIPES / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise ValueError(f"--config-name={name}: no recipe recipes/{name}.yaml (known: {known})")
    return name, rest


def load(overrides: list[str] | tuple[str, ...] = (), config_name: str = "train",
         config_dir: str | Path = RECIPES) -> TrainConfig:
    """Compose recipes/<config_name>.yaml over the TrainConfig schema with command-line style overrides.
    Unknown keys, a bad override or a bad value -> ValueError with one line naming it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        return to_train_config(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(_one_line(e)) from None


def to_train_config(cfg) -> TrainConfig:
    """A composed DictConfig (e.g. from @hydra.main) -> validated TrainConfig."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _check_keys(OmegaConf.to_container(cfg, resolve=False), TrainConfig, "")
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(_one_line(e)) from None
    if not isinstance(obj, TrainConfig):
        raise ValueError(f"config does not use the {SCHEMA_NAME} schema (got {type(obj).__name__})")
    return obj


def _check_keys(node, schema, prefix: str) -> None:
    """Every key of the composed config is a field of its dataclass (hydra's '+key=value' can add keys)."""
    import dataclasses

    if not isinstance(node, dict) or not dataclasses.is_dataclass(schema):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for k, v in node.items():
        if k not in fields:
            raise ValueError(f"unknown config key {prefix + str(k)!r}; known here: {sorted(fields)}")
        sub = fields[k].default_factory if fields[k].default_factory is not dataclasses.MISSING else None
        if isinstance(v, dict) and sub is not None and dataclasses.is_dataclass(sub):
            _check_keys(v, sub, f"{prefix}{k}.")


def _one_line(e: Exception) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    cause = e.__cause__ or e.__context__
    first = str(e).strip().splitlines()[0]
    if isinstance(cause, ValueError) and not isinstance(cause, OmegaConfBaseException):
        return str(cause).splitlines()[0]      # a __post_init__ check surfaced through OmegaConf
    key = _unknown_key(str(e))
    if key is not None or isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = getattr(cause, "full_key", None) or key
        return f"unknown config key {key!r} ({first})"
    full_key = getattr(e, "full_key", None) or getattr(cause, "full_key", None)
    detail = str(cause).strip().splitlines()[0] if isinstance(cause, OmegaConfBaseException) else first
    return f"{full_key}: {detail}" if full_key else first
