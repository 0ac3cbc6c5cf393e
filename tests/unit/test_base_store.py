"""The sender's base in shared memory (transfer/base_store.py) and the engine's mapped read of a bucket
(transfer/shm.MappedSegment): every tensor's bytes come back from the mappings at the planned offsets, an oversized
tensor in pieces; a bucket is written once, on first use; a flipped byte, a moved piece or a write after the check
is refused by the digest; closing removes every segment."""
import os

import pytest
import torch

from moe_lora_rl.transfer.shm import MappedSegment, layout_entries
from moe_lora_rl.transfer.base_store import BaseStore


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {"big.weight": torch.randn(300, 50, generator=g), "x.bias": torch.randn(7, generator=g),
            "h.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16)}


def _read_back(store, root, tensors):
    """Every tensor put together from the mapped buckets' pieces."""
    flat = {n: torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for n, t in tensors.items()}
    maps = []
    for i in range(len(store.buckets)):
        info = store.info(i)
        seg = MappedSegment(info["handle"], layout_entries(info["pieces"]), info["digest"], info["nbytes"], root)
        maps.append(seg)
        for name, _, _, start, n, _, _, offset in info["pieces"]:
            flat[name][start:start + n] = seg.view[offset:offset + n]
    out = {n: flat[n].view(t.dtype).view(t.shape) for n, t in tensors.items()}
    return out, maps


def test_every_byte_comes_back_from_the_mappings(tmp_path, tensors):
    store = BaseStore(dict(tensors), 16 << 10, 3, root=tmp_path)
    assert len(store.buckets) > 3 and store.written() == 0                 # nothing written before it is asked for
    assert any(p.parts > 1 for b in store.buckets for p in b.pieces)       # big.weight (60 kB) in pieces
    got, maps = _read_back(store, tmp_path, tensors)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert store.written() == len(store.buckets) and store.info(0) is store.info(0)    # written once
    assert all(os.stat(tmp_path / store.info(i)["handle"]).st_mode & 0o777 == 0o600
               for i in range(len(store.buckets)))
    for m in maps:
        m.close()
    store.close()
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="closed"):
        store.info(0)


def test_flipped_byte_moved_piece_and_later_write_are_refused(tmp_path, tensors):
    store = BaseStore(dict(tensors), 16 << 10, 1, root=tmp_path)
    info = store.info(1)
    entries = layout_entries(info["pieces"])
    seg = MappedSegment(info["handle"], entries, info["digest"], info["nbytes"], tmp_path)   # control: accepted
    moved = [list(p) for p in info["pieces"]]
    moved[0][7] += 256
    with pytest.raises(ValueError, match="checksum mismatch"):
        MappedSegment(info["handle"], layout_entries(moved), info["digest"], info["nbytes"], tmp_path)
    with open(tmp_path / info["handle"], "r+b") as f:                        # one byte flipped after the check
        f.seek(info["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ValueError, match="checksum mismatch"):
        seg.verify()                                                          # seen by the check before use
    with pytest.raises(ValueError, match="checksum mismatch"):
        MappedSegment(info["handle"], entries, info["digest"], info["nbytes"], tmp_path)
    with pytest.raises(ValueError, match="holds .* bytes"):
        MappedSegment(info["handle"], entries, info["digest"], info["nbytes"] + 1, tmp_path)
    seg.close()
    store.close()


def test_a_held_segment_is_mapped_through_its_holders_descriptor(tmp_path, tensors):
    """A peer's zero-copy export (vllm/base_export.SharedExport): a segment mapped with keep_fd is mapped again through
    proc_handle(fd) after its sender removed it, with the same bytes and the sender's digest; a byte flipped in the
    held pages is refused; a descriptor that is not one of our segments, or is closed, is refused by name."""
    from moe_lora_rl.transfer.shm import proc_handle

    store = BaseStore(dict(tensors), 16 << 10, 3, root=tmp_path)
    info = store.info(0)
    entries = layout_entries(info["pieces"])
    held = MappedSegment(info["handle"], entries, info["digest"], info["nbytes"], tmp_path, keep_fd=True)
    store.close()                                                          # the name is gone, the pages are held
    assert not (tmp_path / info["handle"]).exists()
    again = MappedSegment(proc_handle(held.fd), entries, info["digest"], info["nbytes"], tmp_path)
    assert torch.equal(again.view, held.view)
    again.close()
    with open(f"/proc/self/fd/{held.fd}", "r+b") as f:                   # one byte of the held pages flipped
        f.seek(info["nbytes"] // 2)
        c = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([c[0] ^ 1]))
    with pytest.raises(ValueError, match="checksum mismatch"):
        MappedSegment(proc_handle(held.fd), entries, info["digest"], info["nbytes"], tmp_path)
    other = tmp_path / "not-a-segment"
    other.write_bytes(b"\0" * info["nbytes"])
    fd = os.open(other, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="not a moe_lora_rl segment under"):
            MappedSegment(proc_handle(fd), entries, info["digest"], info["nbytes"], tmp_path)
    finally:
        os.close(fd)
    fd = held.fd
    held.close()
    with pytest.raises(ValueError, match=f"holds no descriptor {fd}"):
        MappedSegment(proc_handle(fd), entries, info["digest"], info["nbytes"], tmp_path)
