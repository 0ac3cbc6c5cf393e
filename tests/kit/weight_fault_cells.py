"""The cells of tests/kit/weight_faults.py: for each weight path, how a correct version is sent and how each fault is
injected into one (the faulty version is the next correct one with one fault, so a half-applied load is seen).
Exceptions inside the engine's load are raised by functions run in the worker (collective_rpc with a callable),
armed for one load and removed after the cell."""
from __future__ import annotations

import os
import threading
import time

import torch

NORM = "model.norm.weight"
MISSING = "model.layers.0.self_attn.o_proj.weight"
BUCKET = 64 << 10                    # bytes: several buckets for the tiny model


# -- faults on a set of checkpoint tensors (each sent last, as in the report) -----------------------------------
def _last(t: dict, name: str, value) -> dict:
    out = {k: v for k, v in t.items() if k != name}
    out[name] = value
    return out


def base_fault(t: dict, fault: str) -> dict:
    if fault == "shape":
        return _last(t, NORM, torch.cat([t[NORM], t[NORM][:1]]))
    if fault == "name":
        return _last(t, "model.not_a_tensor.weight", torch.ones(4))
    if fault == "dtype":
        return _last(t, NORM, t[NORM].to(torch.int32))
    if fault == "missing":
        return {k: v for k, v in t.items() if k != MISSING}
    raise ValueError(fault)


# -- exceptions raised inside the engine's load (run in the worker) -----------------------------------------------
def _arm_process(worker) -> str:
    """The last MoE layer's post-load processing raises once (earlier layers are processed by then)."""
    model = worker.model_runner.model
    name, mod = [(n, m) for n, m in model.named_modules() if "experts" in n and hasattr(m, "quant_method")][-1]
    qm = mod.quant_method
    state = {"armed": True}
    orig = type(qm).process_weights_after_loading

    def raising(layer):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError(f"injected: {name} post-load processing failed")
        return orig(qm, layer)
    qm.process_weights_after_loading = raising
    return name


def _arm_loader(worker) -> str:
    """model.load_weights raises at the last tensor, in vLLM's layerwise reload only (not in a dry run)."""
    model = worker.model_runner.model
    orig = type(model).load_weights
    state = {"armed": True}

    def in_reload() -> bool:
        return any(getattr(getattr(p, "weight_loader", None), "__name__", "") == "online_process_loader"
                   for p in model.parameters())

    def load_weights(weights):
        if not (state["armed"] and in_reload()):
            return orig(model, weights)
        weights = list(weights)

        def gen():
            yield from weights[:-1]
            state["armed"] = False
            raise RuntimeError(f"injected: loading {weights[-1][0]} failed")
        return orig(model, gen())
    model.load_weights = load_weights
    return "load_weights"


def _disarm(worker) -> None:
    model = worker.model_runner.model
    model.__dict__.pop("load_weights", None)
    for n, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None:
            qm.__dict__.pop("process_weights_after_loading", None)


def base_cells(m, which: str) -> None:
    from moe_lora_rl.transfer.shm_sender import send_base

    def rpcs(method, *args):
        return m.llm.collective_rpc(method, args=args)

    def sender(transport):
        return lambda v, kind: send_base(rpcs, m.bases[kind], v, BUCKET, transport=transport)

    def faulty(transport, fault):
        return lambda v: send_base(rpcs, base_fault(m.bases[m.next_kind["base"]], fault), v, BUCKET,
                                   transport=transport)

    def armed(transport, arm):
        def inject(v):
            m.llm.collective_rpc(arm)
            try:
                send_base(rpcs, m.bases[m.next_kind["base"]], v, BUCKET, transport=transport)
            finally:
                m.llm.collective_rpc(_disarm)
        return inject

    def flipped(transport):
        from moe_lora_rl.transfer.shm_sender import send_store
        from moe_lora_rl.transfer.base_store import BaseStore

        def inject(v):
            store = BaseStore(m.bases[m.next_kind["base"]], BUCKET, v)
            try:
                store.data(1)[store.buckets[1].nbytes // 2] ^= 1     # after its digest
                send_store(rpcs, store, transport=transport)
            finally:
                store.close()
        return inject

    def died(v):
        """start and one bucket, then nothing (the sender died); the engine's expiry (moe_lora_expire, run
        periodically by the engine server) after stage_timeout_s."""
        from moe_lora_rl.transfer.base_store import BaseStore

        store = BaseStore(m.bases[m.next_kind["base"]], BUCKET, v)
        try:
            rpcs("moe_lora_base_init", False)
            rpcs("start_weight_update")
            rpcs("update_weights", store.info(0))
        finally:
            store.close()
        time.sleep(m.stage_timeout_s + 0.5)
        out = m.rpc("moe_lora_expire")
        if not out.get("base_expired"):
            return ""
        raise ValueError("the open base update expired (moe_lora_expire)")

    m.correct("base", sender("shm"))                                         # base version 1 serves
    cells = [("shm", "finish", f, faulty("shm", f)) for f in ("shape", "name", "dtype", "missing")]
    cells += [("shm", "load", "exc_process", armed("shm", _arm_process)),
              ("shm", "load", "exc_loader", armed("shm", _arm_loader)),
              ("shm", "receive", "digest", flipped("shm")),
              ("shm", "mid", "sender_died", died)]
    if which == "all":
        cells += [("http", "finish", f, faulty("http", f)) for f in ("shape", "name", "dtype", "missing")]
        cells += [("http", "load", "exc_process", armed("http", _arm_process)),
                  ("http", "receive", "digest", flipped("http"))]
    else:
        cells += [("http", "finish", "shape", faulty("http", "shape"))]
    for path, stage, fault, inject in cells:
        m.cell(f"base/{path}", stage, fault, "base", inject, sender(path), "expired" if fault == "sender_died" else "")
    if which == "all":
        gloo_cells(m)


def gloo_cells(m) -> None:
    """A gloo broadcast group of one engine (transfer/gloo_sender.py): the same faults at finish and in the load."""
    from moe_lora_rl.transfer.gloo_sender import GlooBroadcast
    from moe_lora_rl.transfer.base_store import BaseStore

    with GlooBroadcast([m.rpc]) as cast:
        def send(tensors, v):
            store = BaseStore(tensors, BUCKET, v)
            try:
                cast.send(store)
            finally:
                store.close()

        def correct(v, kind):
            send(m.bases[kind], v)

        def faulty(fault):
            return lambda v: send(base_fault(m.bases[m.next_kind["base"]], fault), v)

        def armed(v):
            m.llm.collective_rpc(_arm_process)
            try:
                send(m.bases[m.next_kind["base"]], v)
            finally:
                m.llm.collective_rpc(_disarm)
        for fault in ("shape", "missing"):
            m.cell("base/gloo", "finish", fault, "base", faulty(fault), correct)
        m.cell("base/gloo", "load", "exc_process", "base", armed, correct)


def loop_cells(m, which: str) -> None:
    """A sender that dies between start_weight_update and finish while the engine loop serves: requests submitted
    after it are held, then admitted once the loop aborts the update (base_timeout_s)."""
    from vllm import SamplingParams

    from moe_lora_rl.rollout.loop import EngineLoop
    from moe_lora_rl.rollout.tickets import Request
    from moe_lora_rl.transfer.base_store import BaseStore
    from moe_lora_rl.transfer.shm_sender import send_base

    def rpcs(method, *args):
        return m.llm.collective_rpc(method, args=args)

    held = {}

    def inject(v):
        loop = EngineLoop(m.llm, base_timeout_s=m.stage_timeout_s).start()
        store = BaseStore(m.bases[m.next_kind["base"]], BUCKET, v)
        try:
            loop.rpc("moe_lora_base_init", (False,))
            loop.rpc("start_weight_update")
            loop.rpc("update_weights", (store.info(0),))
            t0 = time.perf_counter()
            ticket = loop.submit([Request(s, SamplingParams(max_tokens=2, temperature=0.0)) for s in m.seqs])
            done = []

            def wait():
                done.append(ticket.results())
            th = threading.Thread(target=wait, daemon=True)
            th.start()
            th.join(4 * m.stage_timeout_s + 10)
            held["s"] = time.perf_counter() - t0
            if not done:
                raise RuntimeError(f"requests still held {held['s']:.0f} s after the sender stopped")
            if not all(hasattr(r, "tokens") for r in done[0]):
                raise RuntimeError(f"held requests failed: {done[0]}")
            return f"aborted after {held['s']:.1f} s; requests served"
        finally:
            loop.stop()
            store.close()

    def cell_inject(v):
        msg = inject(v)
        raise ValueError(msg)                      # the update was aborted: a refusal

    rec = m.cell("base/loop", "mid", "sender_died", "base", cell_inject,
                 lambda v, kind: send_base(rpcs, m.bases[kind], v, BUCKET), expect="requests served")
    if rec:
        rec["held_s"] = held.get("s")


# -- adapters ------------------------------------------------------------------------------------------------------
def adapter_fault(t: dict, fault: str) -> dict:
    first = next(iter(t))
    if fault == "shape":
        return _last(t, first, torch.cat([t[first], t[first][:1]]))
    if fault == "name":
        return _last(t, first.replace("gate_proj", "gate_prj"), t[first].clone())
    if fault == "dtype":
        return _last(t, first, t[first].to(torch.int32))
    if fault == "missing":
        return {k: v for k, v in t.items() if k != first}
    raise ValueError(fault)


def _arm_activate(worker) -> str:
    """The adapter runtime's last step of an activation (switching the MoE path) raises once."""
    rt = worker._moe_lora_runtime()
    orig = type(rt)._set_moe_path
    state = {"armed": True}

    def raising(layers):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected: switching the MoE path failed")
        return orig(rt, layers)
    rt._set_moe_path = raising
    return "_set_moe_path"


def _disarm_activate(worker) -> None:
    worker._moe_lora_runtime().__dict__.pop("_set_moe_path", None)


def adapter_cells(m, which: str) -> None:
    from moe_lora_rl.transfer import shm
    from moe_lora_rl.transfer.transports import InprocTransport
    from moe_lora_rl.transfer.wire import checksum, encode_blob
    from moe_lora_rl.checks.route_reference import random_expert_adapter

    rank, alpha = 4, 8.0
    adapters = {k: random_expert_adapter(m.arch, rank, seed=k) for k in (1, 2)}
    pool = shm.SegmentPool()

    def nxt():
        return adapters[m.next_kind["adapter"]]

    def send(path, tensors, v, digest=None):
        digest = digest or checksum(tensors)
        if path == "inproc":
            return InprocTransport(m.llm).push(v, tensors, rank, alpha)
        if path == "push":
            return m.rpc("moe_lora_push", v, digest, tensors, rank, alpha)
        if path == "http":
            return m.rpc("moe_lora_push_blob", v, digest, encode_blob(tensors), rank, alpha)
        if path == "shm":
            handle, seg_digest = pool.write(tensors, v, 0)       # the segment's digest is the one it carries
            return m.rpc("moe_lora_push_shm", v, seg_digest, rank, alpha, handle, shm.entries_of(tensors),
                         os.getpid())
        raise ValueError(path)

    def sender(path):
        return lambda v, kind: send(path, adapters[kind], v)

    def faulty(path, fault):
        return lambda v: send(path, adapter_fault(nxt(), fault), v)

    def flipped(path):
        def inject(v):
            t = dict(nxt())
            digest = checksum(t)
            first = next(iter(t))
            t[first] = t[first].clone()
            t[first].view(-1)[0] += 1.0                 # after its digest
            if path == "shm":                           # the segment's bytes changed after the sender's digest
                handle, seg_digest = pool.write(nxt(), v, 0)
                with open(shm.ROOT / handle, "r+b") as f:
                    f.seek(8)
                    b = f.read(1)
                    f.seek(8)
                    f.write(bytes([b[0] ^ 1]))
                return m.rpc("moe_lora_push_shm", v, seg_digest, rank, alpha, handle, shm.entries_of(nxt()),
                             os.getpid())
            if path == "inproc":                        # the staged push, its digest taken before the flip
                m.rpc("moe_lora_begin", v, digest, rank, alpha, 1, None)
                m.rpc("moe_lora_bucket", v, 0, t)
                return m.rpc("moe_lora_commit", v)
            return send(path, t, v, digest)
        return inject

    def armed(path):
        def inject(v):
            m.llm.collective_rpc(_arm_activate)
            try:
                send(path, nxt(), v)
            finally:
                m.llm.collective_rpc(_disarm_activate)
        return inject

    def died(v):
        """begin and the first of two buckets, then nothing; the engine's expiry after stage_timeout_s."""
        t = nxt()
        m.rpc("moe_lora_begin", v, checksum(t), rank, alpha, 2, None)
        names = list(t)
        m.rpc("moe_lora_bucket", v, 0, {n: t[n] for n in names[: len(names) // 2]})
        time.sleep(m.stage_timeout_s + 0.5)
        if m.rpc("moe_lora_expire").get("expired") == v:
            raise ValueError("the open adapter stage expired (moe_lora_expire)")

    try:
        m.correct("adapter", sender("inproc"))              # adapter version 1 serves
        paths = ("inproc", "push", "shm", "http") if which == "all" else ("inproc", "shm")
        for path in paths:
            faults = ("shape", "name", "dtype", "missing") if which == "all" or path == "inproc" else ("shape",)
            for fault in faults:
                m.cell(f"adapter/{path}", "commit", fault, "adapter", faulty(path, fault), sender(path))
            m.cell(f"adapter/{path}", "receive", "digest", "adapter", flipped(path), sender(path))
            m.cell(f"adapter/{path}", "activate", "exc_activate", "adapter", armed(path), sender(path))
        m.cell("adapter/inproc", "mid", "sender_died", "adapter", died, sender("inproc"), expect="expired")
    finally:
        pool.close()
