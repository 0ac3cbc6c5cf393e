"""The refit wire format, shared by the trainer side (refit/) and the vLLM plugin (vllm/, which imports it from here;
refit/ never imports vllm/), pure: torch, zlib, safetensors.

    checksum    CRC-32 per tensor over name, dtype, shape and bytes; the adapter's digest chains the per-tensor
                values in name order, so senders that each hold part of the adapter can compute it together
    segment     one digest over a shared-memory segment's entries and bytes in one pass (transfer/shm.py)
    blob        a bucket as base64 safetensors, for JSON transports (/collective_rpc)
    buffer      a bucket as one flat uint8 tensor, tensors back to back in plan order (point-to-point sends);
                `unpack` returns views into it, no copy
"""
from __future__ import annotations

import base64
import zlib

import torch


def bytes_crc(name: str, dtype: torch.dtype, shape: tuple[int, ...], data) -> int:
    """A tensor's wire CRC from its raw bytes (any buffer: a numpy array, a memoryview of a mapping)."""
    crc = zlib.crc32(f"{name}|{dtype}|{tuple(shape)}|".encode())
    return zlib.crc32(data, crc) if len(data) else crc


def tensor_crc(name: str, t: torch.Tensor) -> int:
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return bytes_crc(name, t.dtype, tuple(t.shape), t.view(-1).view(torch.uint8).numpy())


def buffer_crcs(buffer: torch.Tensor, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, int]:
    """tensor_crc of each tensor unpack(buffer, entries) would give, read from the flat buffer's bytes."""
    raw, out, lo = buffer.numpy(), {}, 0
    for name, dtype, shape in entries:
        hi = lo + nbytes(shape, dtype)
        out[name] = bytes_crc(name, dtype, tuple(shape), raw[lo:hi])
        lo = hi
    return out


def combine(crcs: dict[str, int]) -> str:
    """The adapter digest from per-tensor CRCs (any split of the tensors over senders gives the same digest)."""
    crc = 0
    for name in sorted(crcs):
        crc = zlib.crc32(f"{name}:{crcs[name]:08x};".encode(), crc)
    return f"crc32:{crc:08x}:{len(crcs)}"


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """Detects corrupted, truncated or renamed payloads at memory speed (sha256 would cost more than the move)."""
    return combine({n: tensor_crc(n, t) for n, t in tensors.items()})


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def _segment_hashers() -> dict:
    out = {"crc32": _Crc32}
    try:
        import xxhash
    except ImportError:                 # the digest names its algorithm: a receiver without it refuses, never skips
        return out
    out["xxh3"] = xxhash.xxh3_64
    return out


SEGMENT_HASHERS = _segment_hashers()
SEGMENT_ALGO = "xxh3" if "xxh3" in SEGMENT_HASHERS else "crc32"


class SegmentHash:
    """The digest of a shared-memory segment: its entries (names, dtypes, shapes, in order), then all its bytes,
    fed in any pieces (update) in order: xxh3-64 where the xxhash package is installed, else CRC-32; the digest
    names the algorithm. Detects a changed byte, a reordered, renamed or reshaped tensor, a truncated payload."""

    def __init__(self, entries: list, algo: str | None = None):
        self.algo = algo or SEGMENT_ALGO
        if self.algo not in SEGMENT_HASHERS:
            raise ValueError(f"segment digest algorithm {self.algo!r} is not available here (have "
                             f"{sorted(SEGMENT_HASHERS)})")
        self.n = len(entries)
        self._h = SEGMENT_HASHERS[self.algo]()
        self._h.update(repr([[str(n), str(d).removeprefix("torch."), [int(x) for x in s]]
                             for n, d, s in entries]).encode())

    def update(self, data) -> "SegmentHash":
        if len(data):
            self._h.update(data)
        return self

    def digest(self) -> str:
        return f"seg-{self.algo}:{self._h.intdigest():016x}:{self.n}"


def segment_digest(entries: list, data, algo: str | None = None) -> str:
    """SegmentHash of the whole segment's bytes in one piece."""
    return SegmentHash(entries, algo).update(data).digest()


def segment_algo(digest: str) -> str:
    """The algorithm a segment digest names (ValueError for anything that is not a segment digest)."""
    if not isinstance(digest, str) or not digest.startswith("seg-") or digest.count(":") != 2:
        raise ValueError(f"{digest!r} is not a shared-memory segment digest (seg-<algo>:<hex>:<n>)")
    return digest[4:digest.index(":")]


def encode_blob(tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save

    return base64.b64encode(save({k: v.contiguous() for k, v in tensors.items()})).decode()


def decode_blob(blob_b64: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(base64.b64decode(blob_b64))


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def unpack(buffer: torch.Tensor, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Views of a flat uint8 buffer as the named tensors, back to back in `entries` order."""
    sizes, offset = [], 0
    for name, dtype, shape in entries:
        n = nbytes(shape, dtype)
        if offset + n > buffer.numel():
            raise ValueError(f"buffer of {buffer.numel()} bytes too short for {name} at offset {offset}")
        sizes.append(n)
        offset += n
    if offset != buffer.numel():
        raise ValueError(f"buffer of {buffer.numel()} bytes holds {offset} bytes of tensors")
    parts = torch.split(buffer, sizes)                  # one call for every tensor's bytes
    return {name: p.view(dtype).view(shape) for (name, dtype, shape), p in zip(entries, parts)}


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host tensors that each own exactly their bytes, for anything that pickles them (Ray's object store, an RPC).

    Pickling a tensor carries its whole storage: a view `unpack` returned (one of N tensors of a 64 MiB bucket)
    pickles as the whole bucket, once per tensor, N x the bucket. A tensor that already owns its storage (offset 0,
    storage size = its bytes, contiguous, on the host) is passed as is; any other is copied. Same names, values."""
    out = {}
    for n, t in tensors.items():
        t = t.detach()
        whole = (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        out[n] = t if whole else t.to("cpu", copy=True, memory_format=torch.contiguous_format)
    return out
