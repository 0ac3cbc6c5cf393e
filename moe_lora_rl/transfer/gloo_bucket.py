"""One bucket of bytes broadcast over a process group from rank 0, with an agreement before and after (used by the
sender in transfer/gloo_sender.py and the engine in vllm/base_sync.py):

    agree(everyone ready) -> broadcast(bucket) -> every receiver checks the digest -> agree(everyone holds it)

A party that refuses (a bad bucket description, a failed digest) says so in the agreement, so nobody waits for a
broadcast that will not come and every party learns that the bucket failed. The group is built from a TCP store
without torch.distributed's default group (the trainer's ranks and vLLM's workers have their own), its rendezvous
under a secret key:
- join(...):      gloo (torch.distributed's ProcessGroupGloo), host memory: CPU and any host;
- join_nccl(...): NCCL (vLLM's PyNcclCommunicator over its StatelessProcessGroup, the documented way to join
                  vLLM workers and a trainer), the bucket in device memory. A receiver checks the digest on a host
                  copy of the bucket. CUDA only: refused in one line without it, and never run on the CPU machines
                  that test this project.
"""
from __future__ import annotations

import datetime

import torch


def join(host: str, port: int, rank: int, world: int, timeout_s: float, key: str, store=None):
    """This process's member of the group (rank 0 hosts the TCP store, or passes its own `store`). key: a secret the
    sender hands each engine over its authenticated RPC; the group's rendezvous lives under it in the store, so a
    process that reaches the store's port without the key cannot join the group or learn where its members listen."""
    import torch.distributed as dist

    store, timeout = _keyed_store(host, port, rank, world, timeout_s, key, store, "gloo")
    return dist.ProcessGroupGloo(store, int(rank), int(world), timeout)


class NcclGroup:
    """An NCCL communicator for the bucket protocol, and the device its buffers live on."""

    def __init__(self, comm, device: torch.device):
        self.comm, self.device = comm, device


def join_nccl(host: str, port: int, rank: int, world: int, timeout_s: float, key: str, device, store=None) -> NcclGroup:
    """This process's member of an NCCL group on `device` (a CUDA device), rendezvous as join()'s; ValueError
    without CUDA."""
    if not torch.cuda.is_available():
        raise ValueError("base_transport='nccl' needs CUDA in every process of the group; this one has none "
                         "(use gloo on CPU)")
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    store, _ = _keyed_store(host, port, rank, world, timeout_s, key, store, "nccl")
    device = torch.device(device)
    group = StatelessProcessGroup(rank=int(rank), world_size=int(world), store=store)
    return NcclGroup(PyNcclCommunicator(group, device=device), device)


def _keyed_store(host, port, rank, world, timeout_s, key, store, backend):
    """The group's rendezvous: the TCP store (rank 0 hosts it) under the group's key; and the timeout."""
    import torch.distributed as dist

    if not isinstance(key, str) or len(key) < 16:
        raise ValueError(f"a {backend} group needs a key of at least 16 characters (transfer/gloo_sender.py makes "
                         "one)")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    if store is None:
        store = dist.TCPStore(host, int(port), int(world), rank == 0, timeout=timeout)
    prefix = "moe_lora_base" if backend == "gloo" else f"moe_lora_base_{backend}"
    return dist.PrefixStore(f"{prefix}/{key}", store), timeout


def device_of(pg) -> torch.device:
    """Where the group's buffers live: the NCCL group's device, host memory for gloo."""
    return pg.device if isinstance(pg, NcclGroup) else torch.device("cpu")


def agree(pg, ok: bool) -> bool:
    """True when every party is ok."""
    import torch.distributed as dist

    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device_of(pg))
    if isinstance(pg, NcclGroup):
        return int(pg.comm.all_reduce(flag).item()) == 0          # the sum of the refusals
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([flag], opts).wait()
    return int(flag.item()) == 0


def broadcast(pg, data: torch.Tensor) -> None:
    import torch.distributed as dist

    if isinstance(pg, NcclGroup):
        pg.comm.broadcast(data, src=0)
        return
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([data], opts).wait()


def send(pg, data: torch.Tensor, index: int) -> None:
    """Rank 0: bucket `index`'s bytes to every receiver; ValueError when a receiver refused it (its own error says
    why)."""
    if not agree(pg, True):
        raise ValueError(f"bucket {index}: a receiver refused it before the broadcast")
    broadcast(pg, data.to(device_of(pg)).contiguous())
    if not agree(pg, True):
        raise ValueError(f"bucket {index}: a receiver refused it after the broadcast (checksum)")


def receive(pg, nbytes: int, index: int, problem: BaseException | None, check) -> torch.Tensor:
    """A receiver: the bucket's bytes in a private buffer on the group's device, check(host bytes) raising on a bad
    digest. `problem`: this receiver's own refusal, raised after the group learned of it."""
    if not agree(pg, problem is None):
        raise problem or ValueError(f"bucket {index}: refused by another party of the broadcast")
    buf = torch.empty(int(nbytes), dtype=torch.uint8, device=device_of(pg))
    broadcast(pg, buf)
    err = None
    try:
        check(buf if buf.device.type == "cpu" else buf.cpu())
    except ValueError as e:
        err = e
    if not agree(pg, err is None):
        raise err or ValueError(f"bucket {index}: refused by another receiver of the broadcast")
    return buf
