"""A bucket carried inside the call (transport http): its bytes base64 in the update info, for an engine that cannot
map the sender's shared-memory segments (on another host). The receiver decodes them into a private buffer and checks
the same digest as for a mapped segment.

    info = encode_inline(store.info(i), store.data(i))       # the sender (shm_sender.py), or a peer's export
    data = decode_inline(update_info)                         # the engine (vllm/base_sync.py)
"""
from __future__ import annotations

import torch


def encode_inline(info: dict, data: torch.Tensor) -> dict:
    """A bucket's update info carrying its bytes (transport http): for an engine that cannot map the sender's
    segments (another host)."""
    import base64

    return {**info, "handle": "", "transport": "http", "data": base64.b64encode(data.numpy()).decode("ascii")}


def decode_inline(u) -> torch.Tensor:
    """An http bucket's bytes (u: vllm/base_sync.UpdateInfo) in a private buffer, checked against its digest;
    ValueError naming what is wrong."""
    import base64
    import binascii

    from .shm import check_digest, layout_entries

    try:
        raw = bytearray(base64.b64decode(u.data, validate=True))
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"http bucket {u.index}: its data is not base64 ({e})") from e
    if len(raw) != int(u.nbytes):
        raise ValueError(f"http bucket {u.index}: {len(raw)} bytes arrived, {u.nbytes} were described")
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    check_digest(data, layout_entries(u.pieces), u.digest, f"http bucket {u.index}")
    return data
