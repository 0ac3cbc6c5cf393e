"""Shared-memory refit segments: round trip with private (0600) files, CRC-checked; a stale handle, a foreign name,
a size or checksum mismatch are ValueErrors; segments of dead processes are removed on start."""
import os
import stat
import subprocess
import sys

import pytest
import torch

from moe_lora_rl.refit import shm
from moe_lora_rl.refit.wire import checksum, combine


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.lora_A.weight": torch.randn(4, 8, generator=g), "a.lora_B.weight": torch.randn(8, 4, generator=g),
            "b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}


def test_round_trip_private_and_removed(tmp_path, tensors):
    h = shm.write_segment(tensors, 3, 0, root=tmp_path)
    assert h.startswith(f"moe_lora_rl-{os.getpid()}-3-0-")
    assert stat.S_IMODE((tmp_path / h).stat().st_mode) == 0o600
    got = shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    shm.remove(h, root=tmp_path)
    assert not list(tmp_path.iterdir())
    assert torch.equal(got["b"], tensors["b"])                 # still readable after the segment is gone
    with pytest.raises(ValueError, match="stale shared-memory handle"):
        shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path)


def test_bad_handles(tmp_path, tensors):
    with pytest.raises(ValueError, match="not a moe_lora_rl segment"):
        shm.read_segment("../etc/passwd", [], "", root=tmp_path)
    h = shm.write_segment(tensors, 1, 0, root=tmp_path)
    bad = {**tensors, "b": tensors["b"] + 1}
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, shm.entries_of(tensors), checksum(bad), root=tmp_path)
    with pytest.raises(ValueError, match="holds .* bytes"):
        shm.read_segment(h, shm.entries_of({"x": torch.zeros(3)}), "", root=tmp_path)


def test_stale_segments_of_dead_pids_removed(tmp_path, tensors):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"moe_lora_rl-{dead}-1-0-abcd").write_bytes(b"x")
    mine = shm.write_segment(tensors, 1, 0, root=tmp_path)
    assert shm.remove_stale(root=tmp_path) == [f"moe_lora_rl-{dead}-1-0-abcd"]
    assert [p.name for p in tmp_path.iterdir()] == [mine]


def test_crcs_while_writing_give_the_digest(tmp_path, tensors):
    crcs = {}
    h = shm.write_segment(tensors, 2, 0, root=tmp_path, crcs=crcs)
    assert sorted(crcs) == sorted(tensors) and combine(crcs) == checksum(tensors)
    got = shm.read_segment(h, shm.entries_of(tensors), combine(crcs), root=tmp_path)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    (tmp_path / h).write_bytes((tmp_path / h).read_bytes()[:-1] + b"\x01")   # one byte changed after the CRC
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, shm.entries_of(tensors), combine(crcs), root=tmp_path)


def test_pool_reuses_one_segment_per_size_with_a_fresh_handle(tmp_path, tensors):
    pool = shm.SegmentPool(root=tmp_path)
    crcs1 = {}
    h1 = pool.write(tensors, 1, 0, crcs=crcs1)
    assert stat.S_IMODE((tmp_path / h1).stat().st_mode) == 0o600 and combine(crcs1) == checksum(tensors)
    got1 = shm.read_segment(h1, shm.entries_of(tensors), combine(crcs1), root=tmp_path)
    other = {k: v * 2 for k, v in tensors.items()}
    crcs2 = {}
    h2 = pool.write(other, 2, 0, crcs=crcs2)
    assert h2 != h1 and [p.name for p in tmp_path.iterdir()] == [h2]        # same segment, renamed
    assert combine(crcs2) == checksum(other)
    with pytest.raises(ValueError, match="stale shared-memory handle"):     # the previous push's handle
        shm.read_segment(h1, shm.entries_of(tensors), combine(crcs1), root=tmp_path)
    got2 = shm.read_segment(h2, shm.entries_of(other), combine(crcs2), root=tmp_path)
    assert all(torch.equal(got2[k], v) for k, v in other.items())
    assert all(torch.equal(got1[k], v) for k, v in tensors.items())           # the server's copy is its own
    h3 = pool.write({"x": torch.ones(5)}, 3, 1)                              # another size: another segment
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([h2, h3])
    pool.close()
    assert not list(tmp_path.iterdir())


def test_pool_detects_corruption_of_any_byte(tmp_path, tensors):
    """The CRCs are computed on the bytes in the segment: a byte changed after the write (in any tensor, first
    or last byte) or entries that name another layout fail the read."""
    pool = shm.SegmentPool(root=tmp_path)
    crcs = {}
    h = pool.write(tensors, 1, 0, crcs=crcs)
    entries, digest = shm.entries_of(tensors), combine(crcs)
    raw = (tmp_path / h).read_bytes()
    for pos in (0, len(raw) // 2, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        (tmp_path / h).write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="checksum mismatch"):
            shm.read_segment(h, entries, digest, root=tmp_path)
    (tmp_path / h).write_bytes(raw)
    assert shm.read_segment(h, entries, digest, root=tmp_path).keys() == tensors.keys()
    swapped = [entries[1], entries[0], entries[2]]                           # same bytes, other tensor order
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, swapped, digest, root=tmp_path)
    pool.close()


def test_read_checks_tensors_larger_than_a_chunk(tmp_path, monkeypatch):
    """Tensors spanning several read chunks and chunks holding several tensors give the same tensors and digest."""
    monkeypatch.setattr(shm, "_CHUNK", 64)
    g = torch.Generator().manual_seed(1)
    big = {"big": torch.randn(100, generator=g), "s1": torch.randn(3, generator=g), "s2": torch.randn(2, generator=g),
           "empty": torch.zeros(0), "tail": torch.randn(33, generator=g)}
    h = shm.write_segment(big, 1, 0, root=tmp_path)
    got = shm.read_segment(h, shm.entries_of(big), checksum(big), root=tmp_path)
    assert all(torch.equal(got[k], v) for k, v in big.items())


def test_receive_buffers_reused_only_once_nothing_views_them(tmp_path, tensors):
    bufs = shm.RecvBuffers()
    h = shm.write_segment(tensors, 1, 0, root=tmp_path)
    got1 = shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path, buffers=bufs)
    ptr1 = got1["b"].untyped_storage().data_ptr()
    got2 = shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path, buffers=bufs)
    ptr2 = got2["b"].untyped_storage().data_ptr()
    assert ptr2 != ptr1                                   # got1 still alive: its buffer is not handed out again
    keep = got1["a.lora_A.weight"][1:]                    # a view derived from one tensor keeps the buffer busy
    del got1
    got3 = shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path, buffers=bufs)
    assert got3["b"].untyped_storage().data_ptr() not in (ptr1, ptr2)
    assert torch.equal(keep, tensors["a.lora_A.weight"][1:])
    del keep, got3
    got4 = shm.read_segment(h, shm.entries_of(tensors), checksum(tensors), root=tmp_path, buffers=bufs)
    assert got4["b"].untyped_storage().data_ptr() == ptr1  # free again: reused
    assert all(torch.equal(got4[k], v) for k, v in tensors.items())
    assert all(torch.equal(got2[k], v) for k, v in tensors.items())
