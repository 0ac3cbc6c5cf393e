"""The bucket plan of a full-weight sync, pure: which bytes of which tensor travel in which bucket, from which sender.

    metas (name, dtype, shape) -> owners (who sends each tensor) -> buckets (each one sender's, <= bucket_bytes,
    pieces aligned) -> the senders' buckets interleaved, so that they take turns and every sender stages its next
    bucket while another's is applied

- the bucket size: checkpoint-engine's rule, min(max(8 GiB, the largest tensor), 0.9 x free / 3), capped by the
  caller (tests and CPU runs use small buckets); a tensor larger than a bucket is cut into pieces of whole elements,
  each piece in its own bucket, and put together by the receiver before it loads the tensor.
- owners: a routed expert's tensors are sent by the expert-parallel rank that holds the expert; every other tensor
  by one data-parallel replica's ranks (spread over them by bytes).
- the receiver's filter (`keep`): an engine rank takes only the tensors it serves (its experts); pieces of a tensor
  it does not keep are never planned for it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

ALIGN = 256                      # byte alignment of each piece inside a bucket
GIB = 1 << 30

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + nbytes) of tensor `name`, at `offset` in its bucket; piece `part` of `parts`."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int
    offset: int
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Bucket:
    index: int
    sender: int
    nbytes: int
    pieces: tuple[Piece, ...]


def bucket_bytes(free_bytes: float, largest: int, cap: int | None = None) -> int:
    """min(max(8 GiB, largest), 0.9 x free / 3) (checkpoint-engine's rule: two staging buffers and the receiver's
    copy fit the free memory), then at most `cap`; a whole number of ALIGN units."""
    b = min(max(8 * GIB, largest), int(0.9 * free_bytes / 3))
    if cap is not None:
        b = min(b, cap)
    b -= b % ALIGN
    if b < ALIGN:
        raise ValueError(f"bucket of {b} bytes from free memory {free_bytes:.0f} bytes and cap {cap}: below one "
                         f"aligned unit ({ALIGN} bytes)")
    return b


def expert_of(name: str) -> int | None:
    """The global routed-expert index of an HF tensor name (…mlp.experts.E.…), or None (shared experts are not
    routed: …mlp.shared_experts.… has no '.experts.<n>.')."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def owners(metas: list[TensorMeta], experts: int, ep: int, replica: list[int]) -> dict[str, int]:
    """Sender rank of each tensor: expert e by the EP rank holding it (rank e // (experts / ep) of the EP group,
    numbered as `replica`'s ranks), everything else by `replica`'s ranks, least loaded first (bytes)."""
    if ep < 1 or experts % ep:
        raise ValueError(f"ep={ep} does not divide experts={experts}")
    if len(replica) < ep:
        raise ValueError(f"replica ranks {replica}: fewer than ep={ep}")
    load = {r: 0 for r in replica}
    out: dict[str, int] = {}
    for m in metas:
        e = expert_of(m.name)
        if e is not None:
            if e >= experts:
                raise ValueError(f"{m.name}: expert {e} is not below experts={experts}")
            out[m.name] = replica[e // (experts // ep)]
            load[out[m.name]] += m.nbytes
    for m in sorted((m for m in metas if expert_of(m.name) is None), key=lambda m: -m.nbytes):
        out[m.name] = min(replica, key=lambda r: (load[r], r))
        load[out[m.name]] += m.nbytes
    return out


def plan(metas: list[TensorMeta], size: int, sender_of: dict[str, int] | None = None, keep=None) -> list[Bucket]:
    """Buckets of at most `size` bytes: each sender's tensors in the given order, cut into pieces where they do not
    fit, then the senders' buckets interleaved (round robin). keep(name) -> bool: the receiver's filter."""
    if size < ALIGN or size % ALIGN:
        raise ValueError(f"bucket size {size}: a positive multiple of {ALIGN}")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} is listed twice")
    per_sender: dict[int, list[list[Piece]]] = {}
    fill: dict[int, int] = {}
    for m in metas:
        if keep is not None and not keep(m.name):
            continue
        s = 0 if sender_of is None else sender_of[m.name]
        own = per_sender.setdefault(s, [[]])
        spans, start = [], 0
        while start < m.nbytes:
            at = fill.get(s, 0)
            room = size - at
            left = m.nbytes - start
            if left <= room:
                n = left                                   # the rest fits here
            elif m.nbytes <= size or room < m.itemsize:
                own.append([])                             # a tensor that fits a bucket is never cut
                fill[s] = 0
                continue
            else:
                n = room - room % m.itemsize               # an oversized tensor fills this bucket first
            spans.append((len(own) - 1, start, n, at))
            own[-1].append(None)                           # its place, filled in below
            fill[s] = at + n + (-(at + n)) % ALIGN
            start += n
            if fill[s] >= size:
                own.append([])
                fill[s] = 0
        for k, (bi, start, n, at) in enumerate(spans):
            own[bi][own[bi].index(None)] = Piece(m.name, m.dtype, m.shape, start, n, at, k, len(spans))
    out: list[Bucket] = []
    queues = {s: [b for b in bs if b] for s, bs in sorted(per_sender.items())}
    while any(queues.values()):
        for s, q in queues.items():
            if q:
                pieces = q.pop(0)
                out.append(Bucket(len(out), s, pieces[-1].offset + pieces[-1].nbytes, tuple(pieces)))
    return out


def check_covers(metas: list[TensorMeta], buckets: list[Bucket], keep=None) -> None:
    """Every kept tensor's bytes exactly once, pieces inside their bucket and not overlapping (AssertionError)."""
    want = {m.name: m.nbytes for m in metas if keep is None or keep(m.name)}
    got: dict[str, list[tuple[int, int]]] = {}
    for b in buckets:
        end = 0
        for p in b.pieces:
            assert p.offset >= end and p.offset % ALIGN == 0, (b.index, p)
            end = p.offset + p.nbytes
            got.setdefault(p.name, []).append((p.start, p.nbytes))
        assert end == b.nbytes, (b.index, end, b.nbytes)
    assert set(got) == set(want), (sorted(set(want) ^ set(got))[:4])
    for name, spans in got.items():
        at = 0
        for start, n in sorted(spans):
            assert start == at, (name, spans)
            at += n
        assert at == want[name], (name, at, want[name])
