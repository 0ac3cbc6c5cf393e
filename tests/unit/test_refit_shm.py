"""Shared-memory refit segments: round trip with private (0600) files, checked against the segment digest (entries +
bytes); a stale handle, a foreign name, a size or digest mismatch, any changed byte, reordered entries, an unknown
digest algorithm are ValueErrors; the sender's pool reuses one segment per size under a fresh handle per push; the
server's receive buffers are reused only once nothing views them; segments of dead processes are removed on start."""
import os
import stat
import subprocess
import sys

import pytest
import torch

from moe_lora_rl.transfer import shm
from moe_lora_rl.transfer.wire import SEGMENT_HASHERS, segment_digest


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {"a.lora_A.weight": torch.randn(4, 8, generator=g), "a.lora_B.weight": torch.randn(8, 4, generator=g),
            "b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}


def _digest(tensors, algo=None):
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()]) if tensors else \
        torch.empty(0, dtype=torch.uint8)
    return segment_digest([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], flat.numpy(), algo)


def test_round_trip_private_and_removed(tmp_path, tensors):
    h, digest = shm.write_segment(tensors, 3, 0, root=tmp_path)
    assert h.startswith(f"moe_lora_rl-{os.getpid()}-3-0-") and digest == _digest(tensors)
    assert stat.S_IMODE((tmp_path / h).stat().st_mode) == 0o600
    got = shm.read_segment(h, shm.entries_of(tensors), digest, root=tmp_path)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    shm.remove(h, root=tmp_path)
    assert not list(tmp_path.iterdir())
    assert torch.equal(got["b"], tensors["b"])                 # still readable after the segment is gone
    with pytest.raises(ValueError, match="stale shared-memory handle"):
        shm.read_segment(h, shm.entries_of(tensors), digest, root=tmp_path)


def test_bad_handles_and_digests(tmp_path, tensors):
    with pytest.raises(ValueError, match="not a moe_lora_rl segment"):
        shm.read_segment("../etc/passwd", [], "", root=tmp_path)
    h, digest = shm.write_segment(tensors, 1, 0, root=tmp_path)
    bad = {**tensors, "b": tensors["b"] + 1}
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, shm.entries_of(tensors), _digest(bad), root=tmp_path)
    with pytest.raises(ValueError, match="holds .* bytes"):
        shm.read_segment(h, shm.entries_of({"x": torch.zeros(3)}), digest, root=tmp_path)
    with pytest.raises(ValueError, match="not a shared-memory segment digest"):
        shm.read_segment(h, shm.entries_of(tensors), "crc32:00000000:3", root=tmp_path)
    with pytest.raises(ValueError, match="'md5' is not available"):
        shm.read_segment(h, shm.entries_of(tensors), "seg-md5:00:3", root=tmp_path)


@pytest.mark.parametrize("algo", sorted(SEGMENT_HASHERS))
def test_any_changed_byte_or_reordered_entries_fail(tmp_path, tensors, algo):
    h, _ = shm.write_segment(tensors, 1, 0, root=tmp_path)
    entries, digest = shm.entries_of(tensors), _digest(tensors, algo)
    assert digest.startswith(f"seg-{algo}:")
    assert shm.read_segment(h, entries, digest, root=tmp_path).keys() == tensors.keys()
    raw = (tmp_path / h).read_bytes()
    for pos in (0, len(raw) // 2, len(raw) - 1):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        (tmp_path / h).write_bytes(bytes(bad))
        with pytest.raises(ValueError, match="checksum mismatch"):
            shm.read_segment(h, entries, digest, root=tmp_path)
    (tmp_path / h).write_bytes(raw)
    swapped = [entries[1], entries[0], entries[2]]                           # same bytes, other tensor order
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, swapped, digest, root=tmp_path)
    reshaped = [entries[0][:2] + [[8, 4]], *entries[1:]]                     # same bytes, other shape
    with pytest.raises(ValueError, match="checksum mismatch"):
        shm.read_segment(h, reshaped, digest, root=tmp_path)


def test_stale_segments_of_dead_pids_removed(tmp_path, tensors):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"moe_lora_rl-{dead}-1-0-abcd").write_bytes(b"x")
    mine, _ = shm.write_segment(tensors, 1, 0, root=tmp_path)
    assert shm.remove_stale(root=tmp_path) == [f"moe_lora_rl-{dead}-1-0-abcd"]
    assert [p.name for p in tmp_path.iterdir()] == [mine]


def test_pool_reuses_one_segment_per_size_with_a_fresh_handle(tmp_path, tensors):
    pool = shm.SegmentPool(root=tmp_path)
    h1, d1 = pool.write(tensors, 1, 0)
    assert stat.S_IMODE((tmp_path / h1).stat().st_mode) == 0o600 and d1 == _digest(tensors)
    got1 = shm.read_segment(h1, shm.entries_of(tensors), d1, root=tmp_path)
    other = {k: v * 2 for k, v in tensors.items()}
    h2, d2 = pool.write(other, 2, 0)
    assert h2 != h1 and [p.name for p in tmp_path.iterdir()] == [h2]        # same segment, renamed
    assert d2 == _digest(other) and d2 != d1
    with pytest.raises(ValueError, match="stale shared-memory handle"):     # the previous push's handle
        shm.read_segment(h1, shm.entries_of(tensors), d1, root=tmp_path)
    got2 = shm.read_segment(h2, shm.entries_of(other), d2, root=tmp_path)
    assert all(torch.equal(got2[k], v) for k, v in other.items())
    assert all(torch.equal(got1[k], v) for k, v in tensors.items())           # the server's copy is its own
    h3, _ = pool.write({"x": torch.ones(5)}, 3, 1)                           # another size: another segment
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([h2, h3])
    pool.close()
    assert not list(tmp_path.iterdir())
    h4, d4 = pool.write(tensors, 4, 0)                                       # closed, then used again (a restart)
    assert [p.name for p in tmp_path.iterdir()] == [h4] and d4 == d1
    del pool                                                                 # garbage-collected: removed too
    assert not list(tmp_path.iterdir())


def test_receive_buffers_reused_only_once_nothing_views_them(tmp_path, tensors):
    bufs = shm.RecvBuffers()
    h, digest = shm.write_segment(tensors, 1, 0, root=tmp_path)
    read = lambda: shm.read_segment(h, shm.entries_of(tensors), digest, root=tmp_path, buffers=bufs)  # noqa: E731
    got1 = read()
    ptr1 = got1["b"].untyped_storage().data_ptr()
    got2 = read()
    ptr2 = got2["b"].untyped_storage().data_ptr()
    assert ptr2 != ptr1                                   # got1 still alive: its buffer is not handed out again
    keep = got1["a.lora_A.weight"][1:]                    # a view derived from one tensor keeps the buffer busy
    del got1
    got3 = read()
    assert got3["b"].untyped_storage().data_ptr() not in (ptr1, ptr2)
    assert torch.equal(keep, tensors["a.lora_A.weight"][1:])
    del keep, got3
    got4 = read()
    assert got4["b"].untyped_storage().data_ptr() == ptr1  # free again: reused
    assert all(torch.equal(got4[k], v) for k, v in tensors.items())
    assert all(torch.equal(got2[k], v) for k, v in tensors.items())


def test_digest_in_pieces_equals_one_pass(tmp_path, monkeypatch):
    """Hashing while writing / reading in pieces (smaller than, equal to and spanning tensors) gives the one-pass
    digest, and the copy is exact."""
    monkeypatch.setattr(shm, "HASH_PIECE", 64)
    g = torch.Generator().manual_seed(1)
    big = {"big": torch.randn(100, generator=g), "s1": torch.randn(3, generator=g), "s2": torch.randn(2, generator=g),
           "empty": torch.zeros(0), "tail": torch.randn(33, generator=g)}
    h, digest = shm.write_segment(big, 1, 0, root=tmp_path)
    assert digest == _digest(big)
    got = shm.read_segment(h, shm.entries_of(big), digest, root=tmp_path)
    assert all(torch.equal(got[k], v) for k, v in big.items())


def test_views_of_one_buffer_written_in_one_copy(tmp_path, monkeypatch):
    """A gathered bucket (wire.unpack's views of one buffer, in order, mixed dtypes) is written as one span: the same
    segment bytes and digest as the tensors written one by one (clones), in pieces smaller than the span. Views out
    of order, or of two buffers, are not a span."""
    from moe_lora_rl.transfer.wire import buffer_crcs, tensor_crc, unpack

    monkeypatch.setattr(shm, "HASH_PIECE", 64)
    g = torch.Generator().manual_seed(2)
    src = {"x": torch.randn(40, generator=g), "e": torch.zeros(0), "h": torch.randn(6, generator=g).bfloat16(),
           "y": torch.randn(3, 5, generator=g)}
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in src.items()]
    buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in src.values()])
    views = unpack(buf, entries)
    assert all(torch.equal(views[n], t) for n, t in src.items())
    assert buffer_crcs(buf, entries) == {n: tensor_crc(n, t) for n, t in src.items()}
    assert shm._span(list(views.values())) is not None
    assert shm._span(list(reversed(views.values()))) is None
    assert shm._span([views["x"], src["y"]]) is None
    h1, d1 = shm.write_segment(views, 1, 0, root=tmp_path)
    h2, d2 = shm.write_segment({n: t.clone() for n, t in views.items()}, 1, 1, root=tmp_path)
    assert d1 == d2 == _digest(src)
    assert (tmp_path / h1).read_bytes() == (tmp_path / h2).read_bytes() == buf.numpy().tobytes()
    same_dtype = [("a", torch.float32, (2, 3)), ("b", torch.float32, (4,))]
    flat = torch.arange(10, dtype=torch.float32).view(torch.uint8)
    got = unpack(flat, same_dtype)
    assert torch.equal(got["b"], torch.arange(6, 10, dtype=torch.float32)) and got["a"].shape == (2, 3)
    with pytest.raises(ValueError, match="too short for b"):
        unpack(flat[:-4], same_dtype)
    with pytest.raises(ValueError, match="holds 40 bytes"):
        unpack(torch.cat([flat, flat[:4]]), same_dtype)
