"""The gloo bucket protocol (transfer/gloo_bucket.py) with three parties in threads: every receiver gets the sender's
bytes; a receiver that refuses before the broadcast, or whose check fails after it, makes every party fail for that
bucket (the sender and the other receiver too) instead of leaving anyone waiting, and the group stays usable. An
engine that cannot join the group fails the broadcast at once. A member without the group's key cannot join it."""
import threading

import pytest
import torch

from moe_lora_rl.procs import free_port
from moe_lora_rl.transfer import gloo_bucket


KEY = "k" * 32


def _run(parties):
    """parties[r](pg) for ranks 0..n-1 in threads on one group; each rank's result or exception."""
    port, n = free_port(), len(parties)
    out = [None] * n

    def one(r):
        pg = gloo_bucket.join("127.0.0.1", port, r, n, 30.0, KEY)
        try:
            out[r] = ("ok", parties[r](pg))
        except Exception as e:  # noqa: BLE001 - the result under test
            out[r] = ("error", str(e))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _fails_on(bad):
    def check(buf):
        if bad:
            raise ValueError("checksum mismatch (test)")
    return check


@pytest.mark.parametrize("case", ["ok", "refused_before", "bad_after"])
def test_one_party_refusing_fails_every_party_for_that_bucket(case):
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)

    def sender(pg):
        res = []
        for i in (7, 8):                                        # the next bucket goes through either way
            try:
                gloo_bucket.send(pg, data, i)
                res.append("sent")
            except ValueError as e:
                res.append(str(e))
        return res

    def receiver(refuse, bad):
        def run(pg):
            got = []
            for i in (7, 8):
                try:
                    got.append(gloo_bucket.receive(pg, data.numel(), i,
                                                    ValueError("refused (test)") if refuse and i == 7 else None,
                                                    _fails_on(bad and i == 7)))
                except ValueError as e:
                    got.append(str(e))
            return got
        return run

    out = _run([sender, receiver(case == "refused_before", case == "bad_after"), receiver(False, False)])
    sent, own, other = out[0][1], out[1][1], out[2][1]
    assert sent[1] == "sent" and torch.equal(own[1], data) and torch.equal(other[1], data), out
    if case == "ok":
        assert sent[0] == "sent" and torch.equal(own[0], data) and torch.equal(other[0], data), out
        return
    assert ("before" if case == "refused_before" else "after") in sent[0], out
    assert own[0] == ("refused (test)" if case == "refused_before" else "checksum mismatch (test)"), own
    assert "bucket 7: refused by another" in other[0], other


def test_an_engine_that_cannot_join_fails_the_broadcast_at_once():
    """GlooBroadcast: one engine refuses to join (its error is the one raised) and the sender does not wait for the
    group's timeout; the other engine never joins either."""
    import time

    from moe_lora_rl.transfer.gloo_sender import GlooBroadcast

    def refuses(method, *args):
        if method == "moe_lora_base_init":
            raise ValueError("engine 0 refused moe_lora_base_init (test)")

    def silent(method, *args):
        return None

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="engine 0 refused"):
        GlooBroadcast([refuses, silent], timeout_s=60.0)
    assert time.monotonic() - t0 < 30.0


def test_a_member_without_the_key_does_not_join():
    """The rendezvous lives under the group's key: rank 1 with another key never meets rank 0 (both time out);
    control: the same two joins with one key form the group."""
    def joins(keys, timeout_s):
        port, out = free_port(), {}

        def one(r):
            try:
                out[r] = gloo_bucket.join("127.0.0.1", port, r, 2, timeout_s, keys[r]).size()
            except Exception as e:  # noqa: BLE001 - the result under test
                out[r] = type(e).__name__

        threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    assert joins([KEY, KEY], 30.0) == {0: 2, 1: 2}
    other = joins([KEY, "o" * 32], 3.0)
    assert set(other) == {0, 1} and all(v != 2 for v in other.values()), other
    with pytest.raises(ValueError, match="a gloo group needs a key of at least 16 characters"):
        gloo_bucket.join("127.0.0.1", free_port(), 0, 1, 1.0, "short")


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="the NCCL bucket protocol needs 3 GPUs (a sender and two "
                    "receivers, one device each); the same protocol runs over gloo in the tests above")
def test_nccl_group_carries_the_bucket_and_the_refusals():
    """The gloo test's case bad_after over NCCL (transfer/gloo_bucket.join_nccl): the bytes arrive on each receiver's
    device, a failed check on one receiver fails the bucket for every party, and the next bucket goes through."""
    pytest.importorskip("vllm.distributed.device_communicators.pynccl", reason="vLLM with NCCL support")
    port, data = free_port(), torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    out = [None] * 3

    def one(r):
        pg = gloo_bucket.join_nccl("127.0.0.1", port, r, 3, 60.0, KEY, device=f"cuda:{r}")
        res = []
        for i in (7, 8):
            try:
                if r == 0:
                    gloo_bucket.send(pg, data, i)
                    res.append("sent")
                else:
                    res.append(gloo_bucket.receive(pg, data.numel(), i, None, _fails_on(r == 1 and i == 7)).cpu())
            except ValueError as e:
                res.append(str(e))
        out[r] = res

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert "after the broadcast" in out[0][0] and out[0][1] == "sent", out
    assert out[1][0] == "checksum mismatch (test)" and "refused by another" in out[2][0], out
    assert torch.equal(out[1][1], data) and torch.equal(out[2][1], data), out
