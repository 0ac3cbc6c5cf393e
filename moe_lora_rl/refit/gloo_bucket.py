"""One bucket of bytes broadcast over a gloo process group from rank 0, with an agreement before and after (pure:
torch.distributed's ProcessGroupGloo, used by the sender in weight_sync/ and the engine in vllm/base_sync.py):

    agree(everyone ready) -> broadcast(bucket) -> every receiver checks the digest -> agree(everyone holds it)

A party that refuses (a bad bucket description, a failed digest) says so in the agreement, so nobody waits for a
broadcast that will not come and every party learns that the bucket failed. The group is built from a TCP store
without torch.distributed's default group (the trainer's ranks and vLLM's workers have their own).
"""
from __future__ import annotations

import datetime

import torch


def join(host: str, port: int, rank: int, world: int, timeout_s: float, key: str, store=None):
    """This process's member of the group (rank 0 hosts the TCP store, or passes its own `store`). key: a secret the
    sender hands each engine over its authenticated RPC; the group's rendezvous lives under it in the store, so a
    process that reaches the store's port without the key cannot join the group or learn where its members listen."""
    import torch.distributed as dist

    if not isinstance(key, str) or len(key) < 16:
        raise ValueError("a gloo group needs a key of at least 16 characters (weight_sync/gloo_sender.py makes one)")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if store is None:
        store = dist.TCPStore(host, int(port), int(world), rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"moe_lora_base/{key}", store), int(rank), int(world), timeout)


def agree(pg, ok: bool) -> bool:
    """True when every party is ok."""
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([flag], opts).wait()
    return int(flag.item()) == 0


def broadcast(pg, data: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([data], opts).wait()


def send(pg, data: torch.Tensor, index: int) -> None:
    """Rank 0: bucket `index`'s bytes to every receiver; ValueError when a receiver refused it (its own error says
    why)."""
    if not agree(pg, True):
        raise ValueError(f"bucket {index}: a receiver refused it before the broadcast")
    broadcast(pg, data.contiguous())
    if not agree(pg, True):
        raise ValueError(f"bucket {index}: a receiver refused it after the broadcast (checksum)")


def receive(pg, nbytes: int, index: int, problem: BaseException | None, check) -> torch.Tensor:
    """A receiver: the bucket's bytes in a private buffer, check(buffer) raising on a bad digest. `problem`: this
    receiver's own refusal, raised after the group learned of it."""
    if not agree(pg, problem is None):
        raise problem or ValueError(f"bucket {index}: refused by another party of the broadcast")
    buf = torch.empty(int(nbytes), dtype=torch.uint8)
    broadcast(pg, buf)
    err = None
    try:
        check(buf)
    except ValueError as e:
        err = e
    if not agree(pg, err is None):
        raise err or ValueError(f"bucket {index}: refused by another receiver of the broadcast")
    return buf
