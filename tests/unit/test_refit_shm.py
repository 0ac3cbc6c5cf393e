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
