"""KV memory held by an engine's sequences, read from vLLM's own allocator after every engine step.

    meter = KVMeter(llm)          # an in-process engine (rollout/engine.make_engine)
    meter.sample(decoded, secs)   # after each engine step (the engine loop does it): decoded, the sequences that got
                                  # a token in it; secs, the step's wall seconds
    meter.snapshot()              # cumulative: {"block_bytes", "steps", "block_steps", "seq_steps", "peak_blocks_per_seq",
                                  #              "sliding_window", "block_size", "decode_steps", "decoded_seqs",
                                  #              "decode_s", "decoded_sq", "decoded_x_s"}

Blocks held are the block pool's blocks with a reference (vLLM's `BlockPool`: total - free - its null block), so a
sliding window's freed blocks (`SlidingWindowManager.remove_skipped_blocks`) and evictable prefix-cache blocks
count as free. Per sequence: blocks held over the running requests, time-averaged over engine steps
(block_steps / seq_steps) and at its peak; bytes: times the bytes of one block over every layer (the KV cache
config's tensors / its blocks). Nothing is estimated from lengths.

The engine's occupancy: the sequences that got a token in a step, over the steps that decoded any
(decoded_seqs / decode_steps); decoded_seqs is the number of tokens the engine generated. With the sums of the
steps' seconds s, of b^2 and of b * s (b: the sequences decoded in a step), `step_fit` fits a step's seconds as
fixed_s + per_seq_s * b by least squares: the engine's cost as a function of its occupancy, measured in the run
(plan/shared_host.py reads it). The sums are additive, so fits over windows or engines combine.
"""
from __future__ import annotations


def _scheduler(llm):
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None or not hasattr(core, "scheduler"):
        raise RuntimeError("KVMeter needs the engine core in this process (set_engine_env before vLLM is imported)")
    return core.scheduler


def kv_layout(llm) -> dict:
    """{"block_bytes" (one block over every layer), "block_size", "num_blocks", "sliding_window" (None: full)} of
    the engine's KV cache."""
    cfg = _scheduler(llm).kv_cache_config
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups]
    windows = {getattr(s, "sliding_window", None) for s in specs}
    return {"block_bytes": sum(t.size for t in cfg.kv_cache_tensors) // cfg.num_blocks,
            "block_size": specs[0].block_size, "num_blocks": cfg.num_blocks,
            "sliding_window": windows.pop() if len(windows) == 1 else sorted(windows, key=str)}


class KVMeter:
    def __init__(self, llm):
        self.sched = _scheduler(llm)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.layout = kv_layout(llm)
        self.steps = self.block_steps = self.seq_steps = 0
        self.decode_steps = self.decoded_seqs = self.decoded_sq = 0
        self.decode_s = self.decoded_x_s = 0.0
        self.peak = 0.0

    def sample(self, decoded: int = 0, secs: float = 0.0) -> None:
        if decoded:
            self.decode_steps += 1
            self.decoded_seqs += decoded
            self.decoded_sq += decoded * decoded
            self.decode_s += secs
            self.decoded_x_s += decoded * secs
        running = len(self.sched.running)
        if not running:
            return
        used = self.pool.num_gpu_blocks - 1 - self.pool.get_num_free_blocks()     # 1: the pool's null block
        self.steps += 1
        self.block_steps += used
        self.seq_steps += running
        self.peak = max(self.peak, used / running)

    def snapshot(self) -> dict:
        return {**self.layout, "steps": self.steps, "block_steps": self.block_steps, "seq_steps": self.seq_steps,
                "peak_blocks_per_seq": self.peak, **{k: getattr(self, k) for k in STEP_SUMS}}


STEP_SUMS = ("decode_steps", "decoded_seqs", "decoded_sq", "decode_s", "decoded_x_s")


def step_fit(sums: dict) -> dict | None:
    """{"fixed_s", "per_seq_s"}: a decode step's seconds as fixed_s + per_seq_s * b, least squares over the steps
    the sums hold (STEP_SUMS); None when fewer than two distinct occupancies were seen (nothing to fit)."""
    n, sb, sbb, ss, sbs = (sums.get(k, 0) for k in STEP_SUMS)
    den = n * sbb - sb * sb
    if n < 2 or den <= 1e-9 * max(1.0, n * sbb):
        return None
    per_seq = (n * sbs - sb * ss) / den
    return {"fixed_s": (ss - per_seq * sb) / n, "per_seq_s": per_seq}


def per_seq_bytes(before: dict | None, after: dict) -> dict:
    """KV bytes per running sequence between two snapshots (before None: since the start): time-averaged over the
    engine steps between them; the peak is the engine's so far."""
    b = before or {"block_steps": 0, "seq_steps": 0}
    seqs = after["seq_steps"] - b["seq_steps"]
    blocks = after["block_steps"] - b["block_steps"]
    return {"kv_bytes_per_seq": blocks / seqs * after["block_bytes"] if seqs else 0.0,
            "kv_peak_bytes_per_seq": after["peak_blocks_per_seq"] * after["block_bytes"]}
