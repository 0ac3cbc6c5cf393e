"""The sender's copy of the base in shared memory: the bucket plan's buckets, one segment each (pieces at their
planned offsets), each written once with its digest and then read by every sync that follows: an engine's start,
its restarts after a crash, an engine added later. An engine maps a bucket and reads it where it lies
(transfer/shm.MappedSegment), so a sync from a written store copies nothing on the sending side.

    store = BaseStore(tensors, size=64 << 20, version=1)
    info = store.info(i)           # bucket i written on first use: the vllm/base_sync.py UpdateInfo fields
    store.close()                  # the segments removed (also at exit; after a crash, transfer/shm.remove_stale)

A written bucket is never written again (its engine may map it until its finish): a changed base is a new store.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from pathlib import Path

import torch

from .shm import HASH_PIECE, ROOT, Segment, close_segments, layout_entries, segment_name
from .wire import SegmentHash
from .base_buckets import Bucket, TensorMeta, plan


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def piece_rows(bucket: Bucket) -> list[list]:
    """A bucket's pieces as the receiver gets them: [name, dtype, shape, start, nbytes, part, parts, offset]."""
    return [[p.name, str(p.dtype).removeprefix("torch."), list(p.shape), p.start, p.nbytes, p.part, p.parts, p.offset]
            for p in bucket.pieces]


def _write(dst: torch.Tensor, rows: list[list], sources: list[torch.Tensor]) -> str:
    """Each piece's bytes at its offset of dst (a new segment: the gaps are zero), hashed in order in pieces of
    about HASH_PIECE bytes right after they were written; the segment digest."""
    h, raw, hashed = SegmentHash(layout_entries(rows)), dst.numpy(), 0
    for row, src in zip(rows, sources):
        offset, n = row[7], row[4]
        for lo in range(0, n, HASH_PIECE):
            hi = min(n, lo + HASH_PIECE)
            dst[offset + lo:offset + hi].copy_(src[lo:hi])
            h.update(raw[hashed:offset + hi])
            hashed = offset + hi
    return h.update(raw[hashed:]).digest()


class BaseStore:
    def __init__(self, tensors: dict[str, torch.Tensor], size: int, version: int, root: Path = ROOT):
        if version < 1:
            raise ValueError(f"base version {version}: must be >= 1")
        self.version, self.root = int(version), Path(root)
        self.buckets = plan(metas_of(tensors), size)
        self.nbytes = sum(b.nbytes for b in self.buckets)
        self._tensors: dict[str, torch.Tensor] | None = tensors    # dropped once every bucket is written
        self._infos: dict[int, dict] = {}
        self._segs: dict[int, Segment] = {}
        self._lock = threading.Lock()
        self.write_s = 0.0
        self._finalizer = weakref.finalize(self, close_segments, self._segs)
        atexit.register(self._finalizer)

    def written(self) -> int:
        return len(self._infos)

    def info(self, i: int) -> dict:
        """Bucket i's update info (vllm/base_sync.UpdateInfo's fields), its segment written on first use."""
        with self._lock:
            if i in self._infos:
                return self._infos[i]
            if self._tensors is None:
                raise ValueError("this base store is closed")
            t0 = time.perf_counter()
            b = self.buckets[i]
            rows = piece_rows(b)
            sources = [self._tensors[p.name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                       [p.start:p.start + p.nbytes] for p in b.pieces]
            seg = self._segs[i] = Segment(self.root, segment_name(self.version, i), b.nbytes)
            digest = _write(seg.view, rows, sources)
            self._infos[i] = {"version": self.version, "buckets": len(self.buckets), "index": i, "handle": seg.name,
                              "nbytes": b.nbytes, "digest": digest, "pieces": rows}
            if len(self._infos) == len(self.buckets):
                self._tensors = None
            self.write_s += time.perf_counter() - t0
            return self._infos[i]

    def data(self, i: int) -> torch.Tensor:
        """Bucket i's bytes (a uint8 view of its segment), written on first use."""
        self.info(i)
        return self._segs[i].view

    def close(self) -> None:
        with self._lock:
            self._tensors = None
            self._infos.clear()
            close_segments(self._segs)
