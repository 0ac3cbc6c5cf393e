"""Shared-memory segments for refit buckets between processes on one host (pure: os, mmap, torch; used by the
trainer side and the vLLM plugin, like wire.py).

A segment is a file in /dev/shm created 0600 (private to the user) named `moe_lora_rl-<pid>-<version>-<index>-<rand>`
with a whole adapter's (or one bucket's) tensors back to back (wire.unpack layout). The RPC carries only the handle
(the name), the entries and the digest.

    sender   SegmentPool: one segment per size, created once and mapped; each push renames it (a fresh handle, so
             the previous push's handle is stale), copies every tensor straight into the mapping and computes the
             segment digest (wire.segment_digest: entries + all bytes, one pass) over what was written. Removed by
             close(), at exit, and, after a crash, by `remove_stale` on the next start of either side (the pid is
             in the name).
    server   read_segment: copies the segment once into a private buffer (RecvBuffers: reused once no tensor
             views it) and checks the digest over that copy; the returned tensors are views of that buffer (the
             sender may reuse the segment as soon as the call returned).
"""
from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

import torch

from ..procs import pid_alive
from .wire import SegmentHash, nbytes, segment_algo

ROOT = Path("/dev/shm")
PREFIX = "moe_lora_rl-"
_NAME = re.compile(r"^moe_lora_rl-(\d+)-\d+-\d+-[0-9a-f]+$")
_PROC = re.compile(r"^proc:(\d+):(\d+)$")     # a segment another process holds open (its unlinked file, if so)
HASH_PIECE = 512 << 10           # bytes hashed right after they were written / read (in cache)


def owner_pid(name: str) -> int | None:
    """The pid of the process that made segment `name` (moe_lora_rl-PID-VERSION-INDEX-HEX); None if not one of ours."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def remove_stale(root: Path = ROOT) -> list[str]:
    """Remove segments left by processes that no longer exist; returns their names."""
    removed = []
    for p in root.glob(PREFIX + "*"):
        pid = owner_pid(p.name)
        if pid is not None and not pid_alive(pid):
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


def segment_name(version: int, index: int) -> str:
    return f"{PREFIX}{os.getpid()}-{version}-{index}-{secrets.token_hex(4)}"


def _fill(dst: torch.Tensor, tensors: dict[str, torch.Tensor]) -> str:
    """Copy the tensors back to back into the uint8 tensor dst (a mapping of the segment); returns the segment digest
    of what was written, hashed in pieces of about HASH_PIECE bytes right after they were written (still in cache)."""
    h = SegmentHash([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    raw = dst.numpy()
    span = _span(list(tensors.values()))
    if span is not None:                # views of one buffer, back to back in order (a gathered bucket): one copy
        for lo in range(0, span.numel(), HASH_PIECE):
            hi = min(span.numel(), lo + HASH_PIECE)
            dst[lo:hi].copy_(span[lo:hi])
            h.update(raw[lo:hi])
        return h.digest()
    offset = hashed = 0
    for t in tensors.values():
        t = t.detach()
        k = t.numel() * t.element_size()
        if k:
            dst[offset:offset + k].view(t.dtype).view(t.shape).copy_(t)
        offset += k
        if offset - hashed >= HASH_PIECE:
            h.update(raw[hashed:offset])
            hashed = offset
    return h.update(raw[hashed:offset]).digest()


def _span(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of tensors that lie back to back, in this order, in one CPU storage, as one flat uint8 view; None
    when they do not."""
    ts = [t for t in ts if t.numel()]                 # an empty tensor has no bytes (and no address)
    if not ts or any(t.device.type != "cpu" or not t.is_contiguous() for t in ts):
        return None
    store, end = ts[0].untyped_storage(), ts[0].data_ptr()
    for t in ts:
        if t.untyped_storage().data_ptr() != store.data_ptr() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    start = ts[0].data_ptr() - store.data_ptr()
    flat = torch.empty(0, dtype=torch.uint8).set_(store)
    return flat[start:start + end - ts[0].data_ptr()]


def _total(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Segment:
    """A segment file of `size` bytes, created 0600 under `root` and mapped read-write by its sender (`view`)."""
    def __init__(self, root: Path, name: str, size: int):
        self.root, self.name, self.size = root, name, size
        fd = os.open(root / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size) if size else None
        except BaseException:
            os.close(fd)
            (root / name).unlink(missing_ok=True)
            raise
        os.close(fd)
        self.view = torch.frombuffer(self.map, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)

    def rename(self, name: str) -> None:
        os.rename(self.root / self.name, self.root / name)
        self.name = name

    def close(self) -> None:
        self.view = None
        if self.map is not None:
            self.map.close()
            self.map = None
        (self.root / self.name).unlink(missing_ok=True)


class SegmentPool:
    """The sender's segments, one per size, reused across pushes (the tmpfs pages are allocated once). A write
    gives the segment a new name: a handle is valid for one push only. The server copies the bytes before its RPC
    returns, so one segment per size suffices for pushes sent one after another."""

    def __init__(self, root: Path = ROOT):
        self.root = Path(root)
        self._segs: dict[int, Segment] = {}
        self._finalizer = weakref.finalize(self, close_segments, self._segs)
        atexit.register(self._finalizer)

    def write(self, tensors: dict[str, torch.Tensor], version: int, index: int) -> tuple[str, str]:
        """The tensors in this pool's segment of their size, under a new name: (handle, segment digest of the bytes
        written)."""
        size = _total(tensors)
        seg = self._segs.get(size)
        name = segment_name(version, index)
        if seg is None:
            seg = self._segs[size] = Segment(self.root, name, size)
        else:
            try:
                seg.rename(name)
            except FileNotFoundError:          # removed under us (e.g. remove_stale by a confused peer): recreate
                seg.close()
                seg = self._segs[size] = Segment(self.root, name, size)
        return seg.name, _fill(seg.view, tensors)

    def handles(self) -> list[str]:
        return [s.name for s in self._segs.values()]

    def close(self) -> None:
        """Remove every segment; the pool stays usable (a later write creates its segment again)."""
        close_segments(self._segs)


def close_segments(segs: dict) -> None:
    """Unmap and remove every segment of segs (values: Segment) and empty it."""
    for s in segs.values():
        s.close()
    segs.clear()


def write_segment(tensors: dict[str, torch.Tensor], version: int, index: int,
                  root: Path = ROOT) -> tuple[str, str]:
    """A one-off segment holding the tensors (the caller removes it): (handle, segment digest)."""
    seg = Segment(Path(root), segment_name(version, index), _total(tensors))
    try:
        digest = _fill(seg.view, tensors)
    except BaseException:
        seg.close()
        raise
    name = seg.name
    seg.view = None
    if seg.map is not None:
        seg.map.close()
    return name, digest


class RecvBuffers:
    """The server's receive buffers, by size, reused across pushes: a buffer is handed out again only once no
    tensor views its storage any more (the adapter it held was replaced and dropped), so fresh pages are faulted
    in only while versions overlap. Where torch does not expose a storage's use count, every read allocates."""

    def __init__(self, per_size: int = 2):
        self.per_size = per_size
        self._free: dict[int, list] = {}            # size -> storages; a free one is referenced by this list only
        self._count = getattr(torch._C, "_storage_Use_Count", None)

    def get(self, size: int) -> torch.Tensor:
        storages = self._free.setdefault(size, [])
        if self._count is not None:
            for st in storages:
                if self._count(st._cdata) == 1:
                    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (size,))
        buf = torch.empty(size, dtype=torch.uint8)
        if self._count is not None and len(storages) < self.per_size:
            storages.append(buf.untyped_storage())
        return buf


def _check_handle(handle: str) -> None:
    if not (_NAME.match(str(handle)) or _PROC.match(str(handle))):
        raise ValueError(f"shared-memory handle {handle!r} is not a moe_lora_rl segment name")


def proc_handle(fd: int) -> str:
    """A handle for a segment this process holds open as `fd` (its file may be unlinked already): another process
    of this host opens it through /proc/<pid>/fd/<fd> and maps the same pages."""
    return f"proc:{os.getpid()}:{int(fd)}"


def _resolve(handle: str, root: Path) -> Path:
    """The path to open for a handle: a segment file under root, or a descriptor another process holds open, which
    must be one of our segment files under root (ValueError naming what it is otherwise)."""
    m = _PROC.match(handle)
    if m is None:
        return Path(root) / handle
    path = Path(f"/proc/{m[1]}/fd/{m[2]}")
    try:
        target = os.readlink(path)
    except OSError:
        raise ValueError(f"stale shared-memory handle {handle!r}: process {m[1]} holds no descriptor {m[2]} (it "
                         "exited or closed it); ask again") from None
    where = Path(target.removesuffix(" (deleted)"))
    if where.parent != Path(root) or not _NAME.match(where.name):
        raise ValueError(f"shared-memory handle {handle!r} names {target!r}, not a moe_lora_rl segment under {root}")
    return path


def _open(handle: str, total: int, root: Path):
    """The segment file `handle` opened for reading, its size checked (ValueError naming what is wrong)."""
    _check_handle(handle)
    try:
        f = open(_resolve(handle, root), "rb", buffering=0)
    except FileNotFoundError:
        raise ValueError(f"stale shared-memory handle {handle!r}: the segment no longer exists (removed, or "
                         "reused by a later push of its sender); resend the bucket") from None
    size = os.fstat(f.fileno()).st_size
    if size != total:
        f.close()
        raise ValueError(f"shared-memory segment {handle!r} holds {size} bytes, its entries need {total}")
    return f


def layout_entries(rows: list[list]) -> list[list]:
    """The digest header of a segment of pieces at offsets (a full-weight sync's bucket): rows [name, dtype, shape,
    start, nbytes, part, parts, offset], each piece's name, part and place, so that a digest over the bytes also
    fixes where each piece lies."""
    return [[f"{name}#{part}/{parts}+{start}@{offset}", "uint8", [nbytes]]
            for name, _, _, start, nbytes, part, parts, offset in rows]


def check_digest(data, entries, digest: str, what: str) -> None:
    """ValueError "<what>: checksum mismatch" unless the segment digest of `entries` and the bytes `data` (a buffer
    or a uint8 tensor) is `digest` (its algorithm named by the digest)."""
    h = SegmentHash(_parse(entries), segment_algo(digest))
    h.update(data.numpy() if isinstance(data, torch.Tensor) else data)
    if h.digest() != digest:
        raise ValueError(f"{what}: checksum mismatch (sent {digest}, read {h.digest()})")


class MappedSegment:
    """A segment mapped read-only into this process and checked against the sender's
    digest over all `total` bytes: the reader uses the bytes where they lie, without a private copy. For a sender
    that does not write the segment again while it is mapped (transfer/base_store.py); verify() hashes it again
    before the bytes are used. ValueError as read_segment's. keep_fd: the file stays open (`fd`), so that another
    process can map the same pages through proc_handle(fd) after the sender removed its name."""

    def __init__(self, handle: str, entries, digest: str, total: int, root: Path = ROOT, keep_fd: bool = False):
        _check_handle(handle)
        _parse(entries), segment_algo(digest)                 # ValueError for a bad entry or digest, before opening
        self.handle, self.entries, self.digest, self.total = handle, entries, digest, int(total)
        self.fd = None
        with _open(handle, self.total, root) as f:
            self.map = mmap.mmap(f.fileno(), self.total, prot=mmap.PROT_READ) if self.total else None
            if keep_fd:
                self.fd = os.dup(f.fileno())
        import warnings

        with warnings.catch_warnings():               # read-only pages: torch warns that it cannot mark them so
            warnings.simplefilter("ignore", UserWarning)
            self.view = torch.frombuffer(self.map, dtype=torch.uint8) if self.total else \
                torch.empty(0, dtype=torch.uint8)
        try:
            self.verify()
        except BaseException:
            self.close()
            raise

    def verify(self) -> None:
        check_digest(self.map if self.map is not None else b"", self.entries, self.digest,
                     f"shared-memory segment {self.handle!r}")

    def close(self) -> None:
        """Unmap (left to the garbage collector while a tensor still views the bytes)."""
        self.view = None
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        m, self.map = self.map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass


def read_segment(handle: str, entries, digest: str, root: Path = ROOT,
                 buffers: RecvBuffers | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a segment, copied out once into a private buffer (from `buffers` when given) and checked
    against the sender's segment digest (wire.segment_digest, the algorithm it names); the returned tensors are
    views of that buffer. ValueError for a handle that is not ours, no longer exists, has the wrong size, or whose
    contents fail the digest."""
    _check_handle(handle)
    parsed = _parse(entries)
    algo = segment_algo(digest)
    total = sum(nbytes(shape, dt) for _, dt, shape in parsed)
    with _open(handle, total, root) as f:
        buf = buffers.get(total) if buffers is not None else torch.empty(total, dtype=torch.uint8)
        raw, done, h = buf.numpy(), 0, SegmentHash(parsed, algo)
        while done < total:                         # read a piece, hash it while it is in cache
            end = min(total, done + HASH_PIECE)
            while done < end:
                got = f.readinto(memoryview(raw[done:end]))
                if not got:
                    raise ValueError(f"shared-memory segment {handle!r}: short read at byte {done} of {total}")
                h.update(raw[done:done + got])
                done += got
    got = h.digest()
    del raw
    if got != digest:
        raise ValueError(f"shared-memory segment {handle!r}: checksum mismatch (sent {digest}, read {got})")
    out, lo = {}, 0
    for name, dt, shape in parsed:
        hi = lo + nbytes(shape, dt)
        out[name] = buf[lo:hi].view(dt).view(shape)
        lo = hi
    return out


def remove(handle: str, root: Path = ROOT) -> None:
    try:
        (root / handle).unlink()
    except FileNotFoundError:
        pass
