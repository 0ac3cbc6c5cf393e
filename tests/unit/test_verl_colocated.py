"""The colocated sync's state machine (integration/verl/colocated.py) on hand-made streams: base handed out per
bucket, adapters kept until the last bucket, a repeat of the served version a no-op, every malformed stream refused
with the offending name or value."""
import pytest
import torch

pytestmark = pytest.mark.verl

from moe_lora_rl.integration.verl.colocated import ColocatedSync  # noqa: E402
from moe_lora_rl.integration.verl.weight_sync import META, encode_meta  # noqa: E402

A = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
B = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight"


def header(version=1, base=True, checksum="c1"):
    return META, encode_meta({"version": version, "checksum": checksum, "rank": 4, "alpha": 8, "base": base})


def test_base_per_bucket_adapters_at_the_end():
    s = ColocatedSync(base_sync_done=False)
    buf = torch.arange(6.0)
    b0 = s.bucket([header(), ("model.embed_tokens.weight", buf[:3]), (A, buf[3:])], is_last=False)
    assert [n for n, _ in b0] == ["model.embed_tokens.weight"] and s.base_count == 1
    buf.zero_()                                      # the sender reuses its buffer: adapters were cloned
    assert s.bucket([(B, torch.ones(2))], is_last=True) == []
    assert torch.equal(s.adapters[A], torch.arange(3.0, 6.0)) and set(s.adapters) == {A, B}
    assert s.plan({"version": None, "checksum": None}) == "stage"


def test_same_version_is_a_noop_other_checksum_an_error():
    s = ColocatedSync(base_sync_done=True)
    s.bucket([header(version=3, base=False), (A, torch.ones(2))], is_last=True)
    assert s.plan({"version": 3, "checksum": "c1"}) == "same"
    with pytest.raises(ValueError, match="version 3 is served with checksum c0"):
        s.plan({"version": 3, "checksum": "c0"})


@pytest.mark.parametrize("buckets, base_sync_done, match", [
    ([[("model.norm.weight", torch.ones(1))]], True, "starts with 'model.norm.weight'"),
    ([[header(base=False), (A, torch.ones(1))]], False, "base_sync_done=False.*carries no base"),
    ([[header(base=False), ("model.norm.weight", torch.ones(1))]], True, "base tensor 'model.norm.weight'"),
    ([[header(), header()]], True, "second header"),
])
def test_malformed_streams_refused(buckets, base_sync_done, match):
    s = ColocatedSync(base_sync_done)
    with pytest.raises(ValueError, match=match):
        for b in buckets:
            s.bucket(b, is_last=True)


def test_stream_must_end_and_carry_adapters():
    s = ColocatedSync(base_sync_done=True)
    s.bucket([header(base=False)], is_last=False)
    with pytest.raises(ValueError, match="has not ended"):
        s.plan({})
    s.bucket([], is_last=True)
    with pytest.raises(ValueError, match="version 1 has no adapter tensors"):
        s.plan({"version": None})
    with pytest.raises(ValueError, match="after the last one"):
        s.bucket([], is_last=True)
    with pytest.raises(ValueError, match="without its header"):
        ColocatedSync(True).bucket([], is_last=True)
