"""Run in its own process: our engine's weight stream in both of verl's sync modes into an in-process vLLM engine
(started on dummy weights, as verl starts it) with our verl worker extension; vLLM's prompt log-probs then equal
Megatron+LoRA's. Prints one line "RESULT <json>".

    engine.get_per_tensor_param()  x2     first: header + base + adapters, then header + adapters only
    colocated ("naive"): verl's BucketedWeightSender -> update_weights_from_ipc (base sync, then adapters, version 1)
    checkpoint-engine: MoELoRACheckpointEngine.send_weights -> moe_lora_begin / bucket / commit (version 2)
    base backend: MoELoRABaseCheckpointEngine.send_weights into a second engine started empty: the first stream's
      base through vLLM's weight-transfer calls (transfer/), its adapters (version 1); then version 2
    base backend, mailbox delivery: what a receiver yields (base + version 1, then version 2) into a third engine
      started empty, through verl's sender and update_weights_from_ipc
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os


def megatron_lp(eng, seqs):
    from ..megatron.forward import forward_logits
    from .vllm_logprobs import megatron_logprobs

    return megatron_logprobs(seqs, forward_logits(eng.model, seqs, eng.arch.vocab_size))


def refused_sync(llm, stream, base_sync_done: bool) -> str:
    """colocated_sync of a stream that must be refused: the first line of its error ("" when it was taken)."""
    try:
        colocated_sync(llm, stream, base_sync_done=base_sync_done)
        return ""
    except Exception as e:  # noqa: BLE001
        return str(e).splitlines()[0]


def colocated_sync(llm, stream, base_sync_done: bool, bucket_mb: int = 1) -> dict:
    """verl's colocated sync on the wire: its BucketedWeightSender (shared memory, as verl picks without IPC) on
    verl's ZMQ handle, while the engine runs update_weights_from_ipc (collective_rpc, as verl's ServerAdapter)."""
    import threading

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = (f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-"
              f"{os.environ['VERL_REPLICA_RANK']}-rank-0.sock")
    out: dict = {}

    def rpc():
        try:
            out["res"] = llm.collective_rpc("update_weights_from_ipc", kwargs={
                "peft_config": {"r": 4}, "base_sync_done": base_sync_done, "use_shm": True})[0]
        except Exception as e:  # noqa: BLE001
            out["err"] = e

    def send():
        try:
            asyncio.run(BucketedWeightSender(handle, bucket_size_mb=bucket_mb, use_shm=True).async_send_weights(stream))
        except Exception as e:  # noqa: BLE001
            out["send_err"] = e

    threads = [threading.Thread(target=f, daemon=True) for f in (rpc, send)]
    for th in threads:
        th.start()
    threads[0].join(300)                 # the engine side returns after the last bucket (or fails before it)
    if threads[0].is_alive():
        raise TimeoutError("update_weights_from_ipc did not return within 300 s")
    if "err" not in out:
        threads[1].join(60)
        if "send_err" in out:
            raise out["send_err"]
    if "err" in out:
        raise out["err"]
    r = out["res"]
    return {k: r[k] for k in ("version", "checksum", "base_tensors", "unchanged")}


def mailbox_streams(backend, streams: list) -> list[list]:
    """What one receiver of `backend`'s mailbox delivery yields after each stream is sent (an in-process mailbox:
    the Ray actor's class without Ray)."""
    from ..integration.verl import mailbox

    handle = mailbox.in_process(mailbox.AdapterMailbox())
    sender, receiver = backend(), backend()

    async def run():
        got = []
        for stream in streams:
            await sender.send_weights(iter(stream))
            got.append([item async for item in receiver.receive_weights()])
        return got

    saved, mailbox.mailbox = mailbox.mailbox, lambda: handle
    try:
        return asyncio.run(run())
    finally:
        mailbox.mailbox = saved


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    a = ap.parse_args(argv)
    from .verl_worker import LORA, VERL_CPU_ENV

    for k, v in VERL_CPU_ENV.items():                # verl on our CPU platform (set before verl is imported)
        os.environ.setdefault(k, v)
    import torch

    from ..integration.verl import plugin  # noqa: F401  (registers our engine and the CPU platform, as verl does)
    from ..transfer.transports import InprocTransport
    from .adapters import randomize_adapters
    from ..rollout.vllm_engine import make_engine, set_engine_env
    from .vllm_logprobs import prompt_logprobs
    from ..integration.verl.checkpoint_engine import MoELoRABaseCheckpointEngine, MoELoRACheckpointEngine
    from ..integration.verl.verl_config import WORKER_EXTENSION, MoELoRAEngineConfig
    from ..integration.verl.engine import MoELoRAEngine
    from ..integration.verl.weight_sync import META, decode_meta, encode_meta
    from verl.workers.config import HFModelConfig

    set_engine_env()
    eng = MoELoRAEngine(HFModelConfig(path=a.model, lora=dict(LORA)),
                        MoELoRAEngineConfig(dtype="float32", device="cpu", forward_only=True))
    eng.initialize()
    randomize_adapters(eng.model, seed=3, scale=0.3)          # verl_worker.randomize's scale
    eng.version = 1
    first = list(eng.get_per_tensor_param()[0])
    second = list(eng.get_per_tensor_param()[0])
    colocated_gen, colocated_peft = eng.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    colocated = list(colocated_gen)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, eng.arch.vocab_size, (4, 16), generator=g)
    want = megatron_lp(eng, seqs)
    with eng.disable_adapter():
        base_want = megatron_lp(eng, seqs)

    os.environ.setdefault("VERL_RAY_JOB_ID", f"moe_lora_check_{os.getpid()}")
    os.environ.setdefault("VERL_REPLICA_RANK", "0")
    llm = make_engine(a.model, dtype="float32", prefix_caching=False, extension=WORKER_EXTENSION,
                      load_format="dummy")                  # verl's default: the sync brings the base
    dummy_got = prompt_logprobs(llm, seqs.tolist())
    # colocated ("naive"), as verl's update_weights drives it on the first sync: the base, then the adapters
    base_stream, _ = eng.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    colo_base = colocated_sync(llm, base_stream, base_sync_done=False)
    colo_lora = colocated_sync(llm, iter(colocated), base_sync_done=True)
    colo_got = prompt_logprobs(llm, seqs.tolist())
    # a colocated stream with a corrupted adapter: refused after the last bucket (the sender is not left waiting)
    bad_colo = [(n, t + 1.0 if i == 2 else t) for i, (n, t) in enumerate(colocated)]
    bad_colo[0] = (META, encode_meta(dict(decode_meta(colocated[0][1]), version=5)))
    colo_refused = refused_sync(llm, iter(bad_colo), base_sync_done=True)
    after_bad_colo = prompt_logprobs(llm, seqs.tolist())

    # checkpoint-engine mode: the next version (other adapters) through our backend, adapters only
    randomize_adapters(eng.model, seed=4, scale=0.3)
    eng.version = 2
    v2, peft = eng.get_per_tensor_param()
    v2 = list(v2)
    want2 = megatron_lp(eng, seqs)
    ck = MoELoRACheckpointEngine(bucket_size=1 << 16)
    ck.transports = [InprocTransport(llm)]
    asyncio.run(ck.send_weights(iter(v2)))
    got = prompt_logprobs(llm, seqs.tolist())
    # a stream with a corrupted adapter is refused (checksum) and the served version stays
    bad = [(n, t + 1.0 if i == 2 else t) for i, (n, t) in enumerate(v2)]
    bad[0] = (META, encode_meta(dict(decode_meta(v2[0][1]), version=3)))   # a new version, wrong bytes
    try:
        asyncio.run(ck.send_weights(iter(bad)))
        refused = ""
    except Exception as e:  # noqa: BLE001
        refused = str(e).splitlines()[0]
    after_bad = prompt_logprobs(llm, seqs.tolist())
    # the base too ("moe_lora_base"): a second engine started empty gets verl's first stream (header + base +
    # adapters of version 1) through vLLM's weight-transfer API, then the adapters-only stream of version 2
    del llm
    fresh = make_engine(a.model, dtype="float32", prefix_caching=False, extension=WORKER_EXTENSION,
                        load_format="dummy")
    ck_base = MoELoRABaseCheckpointEngine(bucket_size=1 << 16, base_transport="http")   # the base inline
    ck_base.transports = [InprocTransport(fresh)]
    base_out = asyncio.run(ck_base.send_weights(iter(first)))
    base_got = prompt_logprobs(fresh, seqs.tolist())
    base_out2 = asyncio.run(ck_base.send_weights(iter(v2)))
    base_got2 = prompt_logprobs(fresh, seqs.tolist())
    # "moe_lora_base" through the mailbox (verl's async trainers): a third engine started empty takes what its
    # receiver yields (the base with version 1's adapters, then version 2's adapters alone) through verl's sender
    # and update_weights_from_ipc with base_sync_done=False, as verl's CheckpointEngineWorker drives it
    del fresh
    mail = mailbox_streams(MoELoRABaseCheckpointEngine, [first, v2])
    empty = make_engine(a.model, dtype="float32", prefix_caching=False, extension=WORKER_EXTENSION,
                        load_format="dummy")
    # first a base stream with one tensor a row too long: refused, and the empty engine keeps exactly its dummy
    # weights (the base load is rolled back, vLLM's layerwise state reset), then the right stream loads
    empty_before = prompt_logprobs(empty, seqs.tolist())
    bad_base = [(n, torch.cat([t, t[:1]]) if n == "model.norm.weight" else t) for n, t in mail[0]]
    bad_base_refused = refused_sync(empty, iter(bad_base), base_sync_done=False)
    bad_base_got = prompt_logprobs(empty, seqs.tolist())
    # a base stream missing one tensor: refused before vLLM finalizes (it would keep that layer's old weights)
    short_base = [(n, t) for n, t in mail[0] if n != "model.norm.weight"]
    short_base_refused = refused_sync(empty, iter(short_base), base_sync_done=False)
    short_base_got = prompt_logprobs(empty, seqs.tolist())
    mail_sync1 = colocated_sync(empty, iter(mail[0]), base_sync_done=False)
    mail_got = prompt_logprobs(empty, seqs.tolist())
    mail_sync2 = colocated_sync(empty, iter(mail[1]), base_sync_done=False)
    mail_got2 = prompt_logprobs(empty, seqs.tolist())
    res = {
        "first_meta": decode_meta(first[0][1]), "second_meta": decode_meta(second[0][1]),
        "first_names": len(first) - 1, "first_lora_names": sum(".lora_" in n for n, _ in first),
        "second_names": len(second) - 1, "second_lora_names": sum(".lora_" in n for n, _ in second),
        "peft_config_checkpoint_mode": peft, "colocated_peft_r": colocated_peft["r"],
        "colocated_names": len(colocated) - 1,
        "refit_logprob_diff": float((got - want2).abs().max()), "base_vs_lora": float((base_want - want).abs().max()),
        "v1_vs_v2": float((want2 - want).abs().max()),
        "dummy_vs_megatron_base": float((dummy_got - base_want).abs().max()),
        "colocated_logprob_diff": float((colo_got - want).abs().max()),
        "colocated_base": colo_base, "colocated_lora": colo_lora,
        "colocated_bad_refused": colo_refused, "colocated_after_bad_diff": float((after_bad_colo - want).abs().max()),
        "buckets": ck.last["buckets"], "served": str(ck.last["served"])[:200],
        "bad_refused": refused, "after_bad_diff": float((after_bad - want2).abs().max()),
        "base_backend_out": base_out, "base_backend_diff": float((base_got - want).abs().max()),
        "base_backend_out2": base_out2, "base_backend_diff2": float((base_got2 - want2).abs().max()),
        "bad_base_refused": bad_base_refused, "bad_base_norm": any(n == "model.norm.weight" for n, _ in mail[0]),
        "bad_base_diff": float((bad_base_got - empty_before).abs().max()),
        "short_base_refused": short_base_refused,
        "short_base_diff": float((short_base_got - empty_before).abs().max()),
        "mailbox_names": [len(m) - 1 for m in mail], "mailbox_sync": [mail_sync1, mail_sync2],
        "mailbox_diff": float((mail_got - want).abs().max()), "mailbox_diff2": float((mail_got2 - want2).abs().max()),
    }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
