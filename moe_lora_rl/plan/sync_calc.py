"""Full-weight sync time by calculation: how long a model's base takes to reach every rollout GPU, by broadcast (every
GPU receives the whole model and keeps its slice, as MoonshotAI's checkpoint-engine does in broadcast mode) or
shard-aware (each GPU receives only its tensor/expert-parallel slice from the trainer ranks that hold it).

The time of one update, buckets pipelined (a bucket staged while the previous one is applied):
    T = fixed_s + buckets * bucket_s + max(received / min(in_gbps, apply_gbps), sent / out_gbps)
- received: bytes into the busiest GPU. Broadcast: the whole model. Shard-aware: its share of the experts
  (experts / engine_gpus) and of everything else (non-expert / engine_tp: attention, embeddings and the dense layers
  are replicated over the engine's data-parallel ranks).
- sent: bytes out of the busiest trainer GPU. Broadcast: each bucket once, from its owner, the owners taking turns
  (model / senders); shard-aware: every engine instance's slices (instances * model / senders).
- in_gbps: a GPU's inbound link for this transfer (NVLink inside one node, its NIC across nodes), out_gbps the
  sender's. apply_gbps: how fast an engine loads received bytes into its model (vLLM's load_weights).
- the bucket: checkpoint-engine's rule, min(max(8 GiB, largest tensor), 0.9 * free / 3).

The apply rate and the fixed cost are the only fitted figures: apply_gbps fitted on one published figure
(checkpoint-engine, Kimi-K2 FP8 on 16 H20: 14.36 s, broadcast), fixed_s and bucket_s set to stated guesses; the other
published broadcast figures are then predictions (PUBLISHED, tests/unit/test_sync_calc.py).

Model bytes from the architecture (plan/refit_calc.py's parameter count): bf16 is 2 bytes per parameter; fp8 checkpoints
(DeepSeek-V3 / Kimi-K2 style) hold every linear weight in 1 byte plus one fp32 scale per 128 x 128 block, and the
embeddings, output head, norms and router in bf16.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .refit_calc import SPECS, MoESpec, attention_sum, base_params

GIB = 1 << 30
GB = 1e9

MORE_SPECS = {
    # DeepSeek-V3 / V3.1 (the main model, MTP module left out as vLLM leaves it out): 61 layers, first 3 dense, 256
    # routed experts + 1 shared, hidden 7168, expert FFN 2048, MLA with 128 heads
    "deepseek-v3": MoESpec("deepseek-v3", 61, 58, 256, 7168, 2048, shared_ffn=2048, dense_ffn=18432, vocab=129280,
                           attention=((7168, 1536), (1536, 128 * 192), (7168, 512 + 64), (512, 128 * 256),
                                      (128 * 128, 7168)), router_bias=True),
    # Qwen3-235B-A22B: 94 layers all MoE, 128 experts, hidden 4096, expert FFN 1536, GQA 64 q / 4 kv heads of 128
    "qwen3-235b-a22b": MoESpec("qwen3-235b-a22b", 94, 94, 128, 4096, 1536, vocab=151936,
                               attention=((4096, 8192), (4096, 512), (4096, 512), (8192, 4096))),
}


def spec(name: str) -> MoESpec:
    known = {**SPECS, **MORE_SPECS}
    if name not in known:
        raise ValueError(f"model {name!r}: known models are {', '.join(sorted(known))}")
    return known[name]


def expert_params(s: MoESpec) -> int:
    return s.moe_layers * s.experts * 3 * s.hidden * s.expert_ffn


def linear_params(s: MoESpec) -> int:
    """Every linear weight (experts, shared experts, dense MLPs, attention): what an fp8 checkpoint stores in 1 byte."""
    return (expert_params(s) + s.moe_layers * 3 * s.hidden * s.shared_ffn + s.dense_layers * 3 * s.hidden * s.dense_ffn
            + attention_sum(s, lambda i, o: i * o))


def model_bytes(s: MoESpec, dtype: str) -> dict:
    """{'total', 'experts'} bytes of the checkpoint in `dtype` (bf16 or fp8)."""
    total = base_params(s)
    if dtype == "bf16":
        return {"total": 2 * total, "experts": 2 * expert_params(s)}
    if dtype == "fp8":
        lin = linear_params(s)
        scales = 4 / (128 * 128)
        return {"total": lin * (1 + scales) + 2 * (total - lin), "experts": expert_params(s) * (1 + scales)}
    raise ValueError(f"dtype {dtype!r}: choose bf16 or fp8")


@dataclass(frozen=True)
class Links:
    """Per-GPU figures (GB/s = 1e9 bytes/s) and the fixed costs. Defaults: H800/H20-class nodes of 8 GPUs, NCCL
    broadcast over NVLink ~150 GB/s bus bandwidth, one 400 Gb/s NIC per GPU (50 GB/s each way)."""
    nvlink_gbps: float = 150.0
    nic_gbps: float = 50.0
    gpus_per_node: int = 8
    apply_gbps: float = 75.7          # fitted: Kimi-K2 FP8 on 16 H20 in 14.36 s (fit_apply_gbps)
    fixed_s: float = 0.5              # metadata gather, barriers, post-load processing (a guess)
    bucket_s: float = 0.002           # per bucket: acknowledgement and error all-reduce (a guess)
    free_bytes: float = 24 * GIB      # a rollout GPU's free memory for staging buckets

    def bucket_bytes(self, largest: float) -> float:
        """checkpoint-engine's rule: min(max(8 GiB, the largest tensor), 0.9 x free / 3), refused if the largest
        tensor does not fit (it would have to be chunked)."""
        b = min(max(8 * GIB, largest), 0.9 * self.free_bytes / 3)
        if b < largest:
            raise ValueError(f"a tensor of {largest / GIB:.2f} GiB does not fit a bucket of {b / GIB:.2f} GiB "
                             f"(free {self.free_bytes / GIB:.1f} GiB): chunk it")
        return b


def sync_time(s: MoESpec, dtype: str, engine_gpus: int, instances: int = 1, senders: int | None = None,
              mode: str = "broadcast", links: Links = Links()) -> dict:
    """Seconds to move `s`'s weights to `instances` engines of `engine_gpus` GPUs each (tensor parallel over
    min(engine_gpus, gpus_per_node), experts over all), from `senders` trainer GPUs (default: as many as the
    engines' GPUs). mode: broadcast or shard."""
    if engine_gpus < 1 or instances < 1:
        raise ValueError(f"engine_gpus={engine_gpus}, instances={instances}: each must be >= 1")
    if mode not in ("broadcast", "shard"):
        raise ValueError(f"mode {mode!r}: choose broadcast or shard")
    b = model_bytes(s, dtype)
    gpus = engine_gpus * instances
    senders = senders or gpus
    one_node = gpus <= links.gpus_per_node and senders <= links.gpus_per_node
    link = links.nvlink_gbps if one_node else links.nic_gbps
    if mode == "broadcast":
        received, sent = b["total"], b["total"] / senders
        if not one_node:             # a broadcast tree across nodes moves each node's copy through its 8 NICs
            link = min(links.nvlink_gbps, links.nic_gbps * links.gpus_per_node)
    else:
        tp = min(engine_gpus, links.gpus_per_node)
        received = b["experts"] / engine_gpus + (b["total"] - b["experts"]) / tp
        sent = instances * b["total"] / senders
    largest = s.vocab * s.hidden * 2
    bucket = links.bucket_bytes(largest)
    buckets = math.ceil(received / bucket)
    move = max(received / (min(link, links.apply_gbps) * GB), sent / (link * GB))
    return {"seconds": links.fixed_s + buckets * links.bucket_s + move, "received_gb": received / GB,
            "sent_gb": sent / GB, "model_gb": b["total"] / GB, "buckets": buckets, "bucket_gib": bucket / GIB,
            "link_gbps": link, "mode": mode, "gpus": gpus}


# checkpoint-engine's published figures (README, v0.4.x, vLLM 0.10.2rc1, broadcast mode)
PUBLISHED = (
    {"what": "Qwen3-235B-A22B bf16 on 8 H800", "model": "qwen3-235b-a22b", "dtype": "bf16", "gpus": 8,
     "seconds": 6.22},
    {"what": "DeepSeek-V3.1 fp8 on 256 H20", "model": "deepseek-v3", "dtype": "fp8", "gpus": 256, "seconds": 11.33},
    {"what": "Kimi-K2 fp8 on 16 H20", "model": "kimi-k2", "dtype": "fp8", "gpus": 16, "seconds": 14.36},
    {"what": "Kimi-K2 fp8 on 256 H20", "model": "kimi-k2", "dtype": "fp8", "gpus": 256, "seconds": 16.04},
)


def fit_apply_gbps(row: dict = PUBLISHED[2], links: Links = Links()) -> float:
    """The apply rate that makes sync_time reproduce one published broadcast figure exactly (the apply rate being
    what limits it: below the link's rate)."""
    engine = min(row["gpus"], 8)
    got = sync_time(spec(row["model"]), row["dtype"], engine, instances=row["gpus"] // engine, links=links)
    rate = got["received_gb"] / (row["seconds"] - links.fixed_s - got["buckets"] * links.bucket_s)
    if rate >= got["link_gbps"]:
        raise ValueError(f"{row['what']}: {rate:.1f} GB/s is above the link's {got['link_gbps']} GB/s: the link "
                         "limits it, nothing to fit")
    return rate


def published_check(links: Links = Links()) -> dict:
    """Each published broadcast figure beside the prediction (engines of 8 GPUs; the model on every GPU of the
    job), and the largest relative error."""
    rows = []
    for p in PUBLISHED:
        engine = min(p["gpus"], 8)
        got = sync_time(spec(p["model"]), p["dtype"], engine, instances=p["gpus"] // engine, mode="broadcast",
                        links=links)
        rows.append({**p, "predicted_s": got["seconds"], "error": got["seconds"] / p["seconds"] - 1})
    return {"rows": rows, "calc_error_max": max(abs(r["error"]) for r in rows)}


def kimi_k2_bf16(gpus: int = 128, links: Links = Links()) -> dict:
    """Kimi-K2 in bf16 on `gpus` H800 (80 GB): engines of 32 GPUs (2 TB of weights need at least 26), the trainer
    on the same GPUs; shard-aware and broadcast."""
    s = spec("kimi-k2")
    engine = 32
    if gpus % engine:
        raise ValueError(f"gpus={gpus}: Kimi-K2 bf16 engines take {engine} GPUs each; give a multiple of {engine}")
    return {m: sync_time(s, "bf16", engine, instances=gpus // engine, mode=m, links=links)
            for m in ("shard", "broadcast")} | {"links": asdict(links)}
