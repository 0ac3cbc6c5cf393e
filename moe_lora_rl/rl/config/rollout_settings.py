"""The run config's engine-side settings (rollout engines, deliberate delays) and the value checks every settings
dataclass of rl/config/ uses (ValueError naming the value)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _choice(where: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{where}={value!r}; choose one of {tuple(allowed)}")


def _positive(where: str, value, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
    if ok and value == float("inf"):
        raise ValueError(f"{where}={value!r} must be finite")
    if not ok:
        raise ValueError(f"{where}={value!r} must be {'>= 0' if zero_ok else '> 0'}")


@dataclass
class KVEvictSettings:
    """rollout.kv_compression=snapkv's settings besides the budget (vllm/kv_select.EvictPolicy, same defaults)."""
    sinks: int = 4
    """First positions every sequence keeps."""
    recent: int = 32
    """Last positions every sequence keeps."""
    window: int | None = None
    """Observation window: the last queries whose attention scores the tokens held (null: the recent window)."""
    interval: int = 16
    """Engine steps between two compressions of a sequence."""
    pool: int = 7
    """Max-pool kernel over the scores in position order (odd; 1: none)."""


@dataclass
class RolloutSettings:
    engines: int = 1
    """Rollout engine processes (replicas): each step's groups are spread over them, a whole group on one engine;
    every push goes to every engine; one engine's death restarts that engine only."""
    node: Any = None
    """Host of the rollout engines (a node of the slurm allocation, started there with srun --overlap and reached
    over HTTP), or a list of hosts (engine i on node[i % len]); null: rank 0's host (shared-memory refit)."""
    gpus: list = field(default_factory=list)
    """Device ids the engines may use (CUDA_VISIBLE_DEVICES), split evenly between the engines of a host; empty: the
    engine's default."""
    max_versions: int = 4
    """Adapter versions the engine may hold at once (mode=async with inflight=pin needs max_staleness + 1); each
    costs one adapter's memory in the engine."""
    stage_timeout_s: float = 600.0
    """An engine aborts a staged push that made no progress for this long (its sender died); the served version
    stays, and the next push proceeds."""
    kv_compression: str = "none"
    """Sample on a compressed KV cache (Sparse-RL's sparse rollouts; rollout/kv_compression.py): none; window
    (sliding-window attention on every layer; the engine frees the blocks outside it); or snapkv (importance-based
    eviction: the first tokens, the last ones and those the last queries attend to most; the engine compacts them
    and frees the rest; prefix caching off)."""
    kv_budget: int = 0
    """Tokens of KV each sequence keeps (window: its length; snapkv: after each compression, sinks and recent
    included); 0 with kv_compression=none."""
    kv_evict: KVEvictSettings = field(default_factory=KVEvictSettings)
    """snapkv's settings, e.g. rollout.kv_evict.recent=32 rollout.kv_evict.interval=8 (refused with another
    method)."""
    kv_replay: bool = False
    """kv_compression=snapkv: the trainer replays the sampler's eviction (the KV counterpart of router replay): the
    engine returns each sample's record of its compressions, and every trainer forward on the sample lets each query
    attend to exactly the tokens the engine held for it (policy/kv_masks.py), so the policy trained is the one that
    sampled, not the dense policy."""
    expert_precision: str = "serving"
    """serving=unmerged: the dtype of the routed experts' GEMMs in the engine (vllm/moe_torch.py): serving (the
    rollout dtype) or fp32 (an fp32 copy of the expert weights: vLLM's fused-MoE kernel's numerics; on a CPU
    without bf16 GEMM instructions, e.g. no AVX512_BF16 or AMX, also several times faster: docs/refit.md)."""
    threads: int | None = None
    """Torch threads of each engine on a CPU host; null: every core for one engine, the host's cores split evenly
    between several on it."""
    base_from: str = "disk"
    """Where an engine gets the base weights: disk (it loads the checkpoint); trainer (it starts empty,
    load_format=dummy, and rank 0 sends it the checkpoint it holds through vLLM's weight-transfer calls, at start
    and at every restart: transfer/); peer (from the trainer at start, and after a restart from a live engine,
    which sends the checkpoint bytes it kept while it keeps serving; engines >= 2)."""
    base_bucket_mb: float = 64.0
    """base_from=trainer or peer: the sync's bucket size (MiB)."""
    base_transport: str = "auto"
    """base_from=trainer or peer: how the base travels (rollout/base.py). auto: shared memory to an engine on rank
    0's host, http to one on another node; shm; http (each bucket's bytes inside its call); gloo (one broadcast to
    every engine at once at start; a restarted engine alone); nccl (gloo's broadcast between GPUs: engines given
    rollout.gpus and a trainer on CUDA); ipc (CUDA IPC handles: engines on the trainer's GPU)."""

    def evict(self) -> dict:
        """The snapkv settings the engine gets: {} for another method (where any setting off its default is
        refused by check_compression)."""
        import dataclasses

        ev = self.kv_evict if isinstance(self.kv_evict, KVEvictSettings) else KVEvictSettings(**self.kv_evict)
        if self.kv_compression == "snapkv":
            return dataclasses.asdict(ev)
        default = KVEvictSettings()
        return {k: v for k, v in dataclasses.asdict(ev).items() if v != getattr(default, k)}

    def __post_init__(self):
        from ...rollout.client import DEFAULT_MAX_MODEL_LEN
        from ...rollout.kv_compression import check_compression
        from ...rollout.placement import plan_placements

        check_compression(self.kv_compression, self.kv_budget, DEFAULT_MAX_MODEL_LEN, evict=self.evict())
        if not isinstance(self.kv_replay, bool):
            raise ValueError(f"rollout.kv_replay={self.kv_replay!r} must be true or false")
        if self.kv_replay and self.kv_compression != "snapkv":
            raise ValueError(f"rollout.kv_replay=true replays importance eviction: rollout.kv_compression="
                             f"{self.kv_compression} (it needs snapkv)")

        if not isinstance(self.max_versions, int) or isinstance(self.max_versions, bool) or self.max_versions < 1:
            raise ValueError(f"rollout.max_versions={self.max_versions!r} must be an integer >= 1")
        if self.node is not None and not isinstance(self.node, str):
            self.node = list(self.node)             # a ListConfig from hydra
        placements = plan_placements(self.engines, nodes=self.node, gpus=self.gpus, this_host="")
        _positive("rollout.stage_timeout_s", self.stage_timeout_s)
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise ValueError(f"rollout.threads={self.threads!r} must be an integer >= 1 (or null)")
        _choice("rollout.base_from", self.base_from, ("disk", "trainer", "peer"))
        _positive("rollout.base_bucket_mb", self.base_bucket_mb)
        from ...rollout.base import BASE_TRANSPORTS, check_base_transport

        _choice("rollout.base_transport", self.base_transport, BASE_TRANSPORTS)
        for p in placements:                    # the engines' own refusals, before anything starts
            try:
                check_base_transport(self.base_from, self.base_transport, self.base_bucket_mb, p, None)
            except ValueError as e:
                raise ValueError(f"rollout.{e}") from None
        if self.base_from == "peer" and self.engines < 2:
            raise ValueError(f"rollout.base_from='peer' with rollout.engines={self.engines}: a restarted engine "
                             "takes the base from another live engine, so at least 2 are needed")


@dataclass
class DelaySettings:
    """Seconds added on purpose, to test and measure the asynchronous pipeline's back-pressure (0: none)."""
    train_s: float = 0.0
    """After every update."""
    engine_step_s: float = 0.0
    """After every step of the rollout engine (a slower engine: generation takes longer per token)."""

    def __post_init__(self):
        _positive("delay.train_s", self.train_s, zero_ok=True)
        _positive("delay.engine_step_s", self.engine_step_s, zero_ok=True)
