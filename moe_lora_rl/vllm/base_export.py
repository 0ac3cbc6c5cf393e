"""A peer's base: the base an engine was synced with (and kept, moe_lora_base_init(keep=True)), exported bucket by
bucket to an engine that starts empty (rollout.base_from=peer). base_sync.py's engine makes one of the two at
moe_lora_base_export_begin: SharedExport hands out the very segments it mapped (a peer on this host, no copy),
PeerExport writes the kept tensors into a fresh store."""
from __future__ import annotations

from dataclasses import asdict

import torch


class PeerExport:
    """The base this engine was synced with, for a peer that starts empty: the checkpoint tensors it kept (views of
    the segments it mapped, which stay valid after their sender removed them), written into a store (transfer/
    base_store.py) bucket by bucket as the peer asks for them, so that serving pauses for one bucket's copy at a time."""

    def __init__(self, weights: dict[str, torch.Tensor], bucket_bytes: int, version: int):
        from ..transfer.base_store import BaseStore

        self.store = BaseStore(dict(weights), int(bucket_bytes), version)

    def begin(self) -> dict:
        return {"version": self.store.version, "buckets": len(self.store.buckets), "bytes": self.store.nbytes}

    def bucket(self, i: int, inline: bool = False) -> dict:
        """Bucket i's update info (written now); inline: its bytes in it (transfer/inline.py)."""
        from ..transfer.inline import encode_inline

        if not 0 <= i < len(self.store.buckets):
            raise ValueError(f"bucket {i}: this export has {len(self.store.buckets)}")
        info = self.store.info(i)
        return encode_inline(info, self.store.data(i)) if inline else info

    def close(self) -> None:
        self.store.close()


class SharedExport:
    """The base this engine was synced with over shared memory, for a peer on this host, without a copy: the
    segments it mapped and holds open, each handed out as a descriptor the peer maps (transfer/shm.proc_handle), with
    the first sender's bucket plan and digests, so a peer checks the very bytes the trainer sent. Inline (a peer on
    another host): each bucket's bytes encoded from the mapping."""

    def __init__(self, version: int, buckets: list):
        self.version, self.buckets = version, buckets                   # [(UpdateInfo, MappedSegment)]

    def begin(self) -> dict:
        return {"version": self.version, "buckets": len(self.buckets), "bytes": sum(u.nbytes for u, _ in self.buckets),
                "shared": True}

    def bucket(self, i: int, inline: bool = False) -> dict:
        from ..transfer.shm import proc_handle
        from ..transfer.inline import encode_inline

        if not 0 <= i < len(self.buckets):
            raise ValueError(f"bucket {i}: this export has {len(self.buckets)}")
        u, seg = self.buckets[i]
        info = {**asdict(u), "handle": proc_handle(seg.fd)}          # it came over shm: transport shm, no data
        return encode_inline(info, seg.view) if inline else info

    def close(self) -> None:
        """Nothing of its own: the segments stay the engine's kept base."""
