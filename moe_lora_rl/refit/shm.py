"""Shared-memory segments for refit buckets between processes on one host (pure: os, torch; used by the trainer
side and the vLLM plugin, like wire.py).

A segment is a file in /dev/shm created 0600 (private to the user) named `moe_lora_rl-<pid>-<version>-<index>-<rand>`
with a whole adapter's (or one bucket's) tensors back to back (wire.unpack layout). The RPC carries only the handle
(the name), the entries and the digest. The sender computes the CRCs while writing and removes the segment once the
server's call returned, whatever happened (the server keeps a private mapping); segments of a process that died
are removed by `remove_stale` on the next start of either side (the pid is in the name).
"""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import torch

from ..procs import pid_alive
from .wire import combine, nbytes, tensor_crc, unpack

ROOT = Path("/dev/shm")
PREFIX = "moe_lora_rl-"
_NAME = re.compile(r"^moe_lora_rl-(\d+)-\d+-\d+-[0-9a-f]+$")


def remove_stale(root: Path = ROOT) -> list[str]:
    """Remove segments left by processes that no longer exist; returns their names."""
    removed = []
    for p in root.glob(PREFIX + "*"):
        m = _NAME.match(p.name)
        if m and not pid_alive(int(m.group(1))):
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed


def entries_of(tensors: dict[str, torch.Tensor]) -> list[list]:
    """JSON-able [name, dtype, shape] per tensor, in the order they are written."""
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in tensors.items()]


def _parse(entries) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for name, dtype, shape in entries:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"shared-memory entry {name!r}: unknown dtype {dtype!r}")
        out.append((name, dt, tuple(int(s) for s in shape)))
    return out


def write_segment(tensors: dict[str, torch.Tensor], version: int, index: int, root: Path = ROOT,
                  crcs: dict[str, int] | None = None) -> str:
    """Create a private segment holding the tensors; returns its name (the handle). crcs: a dict filled with each
    tensor's wire CRC, computed while the tensor is in cache for the write (one pass over the source bytes)."""
    name = f"{PREFIX}{os.getpid()}-{version}-{index}-{secrets.token_hex(4)}"
    path = root / name
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        offset = 0
        for n, t in tensors.items():            # one copy, straight into the tmpfs pages (no mmap page faults)
            t = t.detach().contiguous()
            if crcs is not None:
                crcs[n] = tensor_crc(n, t)
            data = t.reshape(-1).view(torch.uint8).numpy()
            offset += os.pwrite(fd, memoryview(data), offset)
        if offset != total:
            raise OSError(f"short write to shared-memory segment {name}: {offset} of {total} bytes")
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return name


def read_segment(handle: str, entries, crc: str, root: Path = ROOT) -> dict[str, torch.Tensor]:
    """The tensors of a segment (a private copy-on-write mapping: the server never writes to the sender's pages).
    ValueError for a handle that is not ours, no longer exists, has the wrong size, or whose contents fail the CRC
    (`crc`: the wire digest of exactly these tensors, so a one-segment push checks the adapter's digest here)."""
    if not _NAME.match(str(handle)):
        raise ValueError(f"shared-memory handle {handle!r} is not a moe_lora_rl segment name")
    parsed = _parse(entries)
    path = root / handle
    total = sum(nbytes(shape, dt) for _, dt, shape in parsed)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"stale shared-memory handle {handle!r}: the segment no longer exists (removed after a "
                         "commit or a crash); resend the bucket") from None
    if size != total:
        raise ValueError(f"shared-memory segment {handle!r} holds {size} bytes, its entries need {total}")
    buf = torch.from_file(str(path), shared=False, size=total, dtype=torch.uint8) if total else \
        torch.empty(0, dtype=torch.uint8)
    tensors = unpack(buf, parsed)
    got = combine({n: tensor_crc(n, t) for n, t in tensors.items()})
    if got != crc:
        raise ValueError(f"shared-memory segment {handle!r}: checksum mismatch (sent {crc}, read {got})")
    return tensors


def remove(handle: str, root: Path = ROOT) -> None:
    try:
        (root / handle).unlink()
    except FileNotFoundError:
        pass
