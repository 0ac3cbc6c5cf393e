"""Our checkpoint backend's mailbox delivery (verl's async trainers) without Ray: the receiver gets the newest
version posted after the one it delivered, as header + adapters that the colocated receiver state machine accepts
without a base; the sync log's verdict per sync, with a stale server as the negative control."""
import asyncio

import pytest
import torch

pytestmark = pytest.mark.verl


def test_mailbox_hands_each_receiver_the_newest_post():
    from moe_lora_rl.integration.verl.mailbox import AdapterMailbox

    async def run():
        box = AdapterMailbox()
        waiting = asyncio.ensure_future(box.take(0, 5.0))              # the receiver asks before the trainer posts
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await box.post({"version": 1}, {"a": torch.ones(1)})
        first = await waiting
        await box.post({"version": 2}, {"a": torch.ones(1) * 2})
        await box.post({"version": 3}, {"a": torch.ones(1) * 3})
        newest = await box.take(first[0], 5.0)                          # missed version 2: gets 3
        with pytest.raises(TimeoutError, match="no adapter version posted within 0 s after delivery 3"):
            await box.take(newest[0], 0.05)
        return first, newest

    first, newest = asyncio.run(run())
    assert first[1]["version"] == 1 and newest[1]["version"] == 3 and float(newest[2]["a"]) == 3.0


def _inproc_mailbox(monkeypatch):
    from moe_lora_rl.integration.verl import mailbox

    box = mailbox.AdapterMailbox()
    handle = mailbox.in_process(box)
    monkeypatch.setattr(mailbox, "mailbox", lambda: handle)
    return box


def test_receive_weights_stream_is_adapters_only_and_accepted_without_a_base(monkeypatch):
    from moe_lora_rl.integration.verl.checkpoint_engine import MoELoRACheckpointEngine
    from moe_lora_rl.integration.verl.colocated import ColocatedSync
    from moe_lora_rl.integration.verl.weight_sync import META, encode_meta

    _inproc_mailbox(monkeypatch)
    meta = {"version": 4, "checksum": "abc", "rank": 2, "alpha": 4.0, "base": True}
    stream = [(META, encode_meta(meta)), ("model.embed_tokens.weight", torch.zeros(3)),   # base: not carried
              ("x.lora_A.weight", torch.ones(2, 3)), ("x.lora_B.weight", torch.zeros(3, 2))]
    sender, receiver = MoELoRACheckpointEngine(), MoELoRACheckpointEngine()

    async def run():
        sent = await sender.send_weights(iter(stream))
        got = [item async for item in receiver.receive_weights()]
        return sent, got

    sent, got = asyncio.run(run())
    assert sent["moe_lora/refit_version"] == 4 and receiver.delivered == 1
    assert [n for n, _ in got] == [META, "x.lora_A.weight", "x.lora_B.weight"]
    sync = ColocatedSync(base_sync_done=False)           # what verl passes on this path: no base arrives, none needed
    assert sync.bucket(got, is_last=True) == []
    assert sync.meta["version"] == 4 and sync.plan({"version": 3}) == "stage" and set(sync.adapters) == {
        "x.lora_A.weight", "x.lora_B.weight"}
    # negative control: a colocated stream that says neither base nor base_from_checkpoint is still refused
    bare = ColocatedSync(base_sync_done=False)
    with pytest.raises(ValueError, match="carries no base weights"):
        bare.bucket([(META, encode_meta({**meta, "base": False}))], is_last=False)


def test_mailbox_post_pickles_each_adapter_alone_not_its_bucket(monkeypatch):
    """The adapters reach send_weights as views of the gather's buckets (transfer/wire.unpack); Ray pickles a view
    with its whole storage, so the wide qwen3_moe's 3,104 adapter tensors of one bucket pickled as 3,104 buckets (the
    one-step-off trainer's actor grew past 10 GB and Ray's memory monitor killed it). What is posted pickles as its
    own bytes; control: the views themselves pickle as one bucket each."""
    import ray.cloudpickle as cloudpickle

    from moe_lora_rl.integration.verl.checkpoint_engine import MoELoRACheckpointEngine
    from moe_lora_rl.integration.verl.weight_sync import META, encode_meta
    from moe_lora_rl.transfer.wire import unpack

    box = _inproc_mailbox(monkeypatch)
    n, shape = 64, (16, 64)                                              # 64 tensors of 4 KiB in a 256 KiB bucket
    entries = [(f"m.layers.{i}.x.lora_A.weight", torch.float32, shape) for i in range(n)]
    bucket = torch.arange(n * 16 * 64, dtype=torch.float32).view(torch.uint8)
    views = unpack(bucket, entries)
    meta = {"version": 1, "checksum": "c", "rank": 16, "alpha": 32.0, "base": False}
    asyncio.run(MoELoRACheckpointEngine().send_weights(iter([(META, encode_meta(meta)), *views.items()])))
    posted = box.item[2]
    assert list(posted) == list(views) and all(torch.equal(posted[k], views[k]) for k in views)
    size = len(cloudpickle.dumps(posted))
    assert size < 1.2 * bucket.numel(), size                              # ~ the adapters' own 256 KiB
    assert len(cloudpickle.dumps(views)) > n / 2 * bucket.numel()          # control: ~ n x the bucket


def test_base_backend_mailbox_hands_the_base_to_each_engine_once(monkeypatch):
    """"moe_lora_base" through the mailbox: the first stream's base stays posted; each receiver yields it with the
    newest adapters until it has delivered it (a receiver that joins later gets it then), adapters only after; each
    stream is what the colocated receiver state machine accepts (with verl's base_sync_done=False on this path)."""
    from moe_lora_rl.integration.verl.checkpoint_engine import MoELoRABaseCheckpointEngine
    from moe_lora_rl.integration.verl.colocated import ColocatedSync
    from moe_lora_rl.integration.verl.weight_sync import META, decode_meta, encode_meta

    _inproc_mailbox(monkeypatch)
    meta = {"version": 1, "checksum": "c1", "rank": 2, "alpha": 4.0, "base": True}
    first = [(META, encode_meta(meta)), ("model.embed_tokens.weight", torch.arange(3.0)),
             ("x.lora_A.weight", torch.ones(2, 3)), ("x.lora_B.weight", torch.zeros(3, 2))]
    second = [(META, encode_meta({**meta, "version": 2, "checksum": "c2", "base": False})),
              ("x.lora_A.weight", torch.ones(2, 3) * 2), ("x.lora_B.weight", torch.ones(3, 2))]
    sender, early, late = (MoELoRABaseCheckpointEngine() for _ in range(3))

    async def run():
        sent = [await sender.send_weights(iter(first))]
        got = {"early1": [item async for item in early.receive_weights()]}
        sent.append(await sender.send_weights(iter(second)))
        got["early2"] = [item async for item in early.receive_weights()]
        got["late"] = [item async for item in late.receive_weights()]          # an engine started after version 1
        restarted = MoELoRABaseCheckpointEngine()                               # a restarted trainer sends the base
        sent.append(await restarted.send_weights(iter(first)))
        got["early3"] = [item async for item in early.receive_weights()]
        return sent, got

    sent, got = asyncio.run(run())
    assert sent[0]["moe_lora/base_version"] == 1 and sent[0]["moe_lora/base_tensors"] == 1, sent
    assert "moe_lora/base_version" not in sent[1] and sent[1]["moe_lora/refit_version"] == 2, sent
    names = {k: [n for n, _ in v] for k, v in got.items()}
    assert names["early1"] == [META, "model.embed_tokens.weight", "x.lora_A.weight", "x.lora_B.weight"], names
    assert names["early2"] == [META, "x.lora_A.weight", "x.lora_B.weight"], names
    assert names["late"] == [META, "model.embed_tokens.weight", "x.lora_A.weight", "x.lora_B.weight"], names
    assert names["early3"] == [META, "x.lora_A.weight", "x.lora_B.weight"], names   # it holds the base already
    assert float(got["late"][2][1][0, 0]) == 2.0 and decode_meta(got["late"][0][1])["version"] == 2  # the newest
    assert torch.equal(got["late"][1][1], torch.arange(3.0))
    for key, n_base in (("early1", 1), ("early2", 0), ("late", 1), ("early3", 0)):
        sync = ColocatedSync(base_sync_done=False)
        assert len(sync.bucket(got[key], is_last=True)) == n_base and sync.plan({"version": None}) == "stage"
    # negative controls: an adapters-only stream without the receiver's base flag is refused; a receiver on
    # "moe_lora_base" with no base ever posted gets a one-line error, not a base-less engine
    with pytest.raises(ValueError, match="carries no base weights"):
        ColocatedSync(base_sync_done=False).bucket([(META, encode_meta(decode_meta(second[0][1])))], is_last=False)
    _inproc_mailbox(monkeypatch)

    async def no_base():
        from moe_lora_rl.integration.verl.checkpoint_engine import MoELoRACheckpointEngine

        await MoELoRACheckpointEngine().send_weights(iter(second))
        return [item async for item in MoELoRABaseCheckpointEngine().receive_weights()]

    with pytest.raises(ValueError, match=r"mailbox post 1 \(adapter version 2\) has no base posted before it"):
        asyncio.run(no_base())


def test_sync_log_verdicts():
    from moe_lora_rl.checks.verl_async import pair_syncs, synced_fraction

    log = [{"side": "server", "version": None, "checksum": None},                # the server's start: nothing sent
           {"side": "trainer", "version": 0, "checksum": "c0"}, {"side": "server", "version": 0, "checksum": "c0"},
           {"side": "trainer", "version": 1, "checksum": "c1"}, {"side": "server", "version": 1, "checksum": "c1"}]
    pairs = pair_syncs(log)
    assert [p["sent"] for p in pairs] == [None, 0, 1] and synced_fraction(pairs) == 1.0
    stale = log[:-1] + [{"side": "server", "version": 0, "checksum": "c0"}]       # version 1 never arrived
    assert synced_fraction(pair_syncs(stale)) == 0.5
    wrong = log[:-1] + [{"side": "server", "version": 1, "checksum": "cX"}]       # the right number, other bytes
    assert synced_fraction(pair_syncs(wrong)) == 0.5
    with pytest.raises(ValueError, match="no server line follows a trainer line"):
        synced_fraction(pair_syncs(log[:1]))


def test_pause_compat_translates_verls_keyword_only_where_needed():
    from moe_lora_rl.integration.verl.engine_compat import PauseCompat, needs_pause_compat

    class New:                                       # vLLM 0.32's AsyncLLM.pause_generation
        calls = []

        async def pause_generation(self, *, mode="abort", clear_cache=True):
            self.calls.append((mode, clear_cache))

        other = 7

    class Old:                                       # the signature verl 0.9.1 calls
        async def pause_generation(self, *, wait_for_inflight_requests=False, clear_cache=True):
            pass

    assert needs_pause_compat(New()) and not needs_pause_compat(Old())
    eng = PauseCompat(New())
    asyncio.run(eng.pause_generation(wait_for_inflight_requests=False, clear_cache=False))
    asyncio.run(eng.pause_generation(wait_for_inflight_requests=True))
    assert New.calls == [("abort", False), ("wait", True)] and eng.other == 7
    with pytest.raises(TypeError):                   # negative control: the bare engine refuses verl's call
        asyncio.run(New().pause_generation(wait_for_inflight_requests=False))
