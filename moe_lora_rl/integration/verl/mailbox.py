"""The rendezvous of our checkpoint-engine backends' mailbox delivery: one named Ray actor per job holding the newest
adapter version the trainer posted (header and host tensors, carried by Ray's object store) with a sequence number,
and, for the "moe_lora_base" backend, the newest base weights posted (a version and host tensors).

    seq = await post(meta, tensors, base=None)       trainer rank 0, once per sync (base: the base tensors, when
                                                     the stream carries them)
    seq, meta, tensors, base = await take(delivered, t, base_have=None)
                                                     each rollout worker: waits (up to t s) for a post newer than
                                                     the one it delivered last, then gets the newest one; with
                                                     base_have (the sequence number of the base it delivered, 0 for
                                                     none), base is (its sequence number, tensors) when it has none,
                                                     else None: the base never trains, so a base posted again (a
                                                     restarted trainer's first stream) is the one it holds

A receiver that missed a post gets the newest (versions only move forward); the mailbox keeps one adapter item, so
that memory stays at one adapter set. The base stays for the job's life (an engine restarted or added later needs
it): one host copy of the base in Ray's object store. The actor is created by whichever side asks first and lives as
long as that process.
"""
from __future__ import annotations

import asyncio

NAME = "moe_lora_adapter_mailbox"


class AdapterMailbox:
    def __init__(self):
        self.seq, self.item, self.base = 0, None, None
        self.cond = asyncio.Condition()

    async def post(self, meta: dict, tensors: dict, base: dict | None = None) -> int:
        async with self.cond:
            self.seq += 1
            self.item = (self.seq, meta, tensors)
            if base is not None:
                self.base = (self.seq, base)
            self.cond.notify_all()
            return self.seq

    async def take(self, delivered: int, timeout_s: float, base_have: int | None = None):
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.seq > delivered), timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no adapter version posted within {timeout_s:.0f} s after delivery {delivered} "
                                   "(rollout.checkpoint_engine.engine_kwargs.moe_lora.mailbox_timeout_s)") from None
            if base_have is None:
                return (*self.item, None)
            if self.base is None:
                raise ValueError(f"mailbox post {self.seq} (adapter version {self.item[1].get('version')}) has no "
                                 "base posted before it: an engine started empty cannot serve it (is the trainer on "
                                 "checkpoint_engine.backend=moe_lora_base too?)")
            return (*self.item, self.base if base_have == 0 else None)


_handle = None


def mailbox():
    """This process's handle (kept: the process that creates the actor owns it, and Ray ends a named actor once
    its owner holds no reference)."""
    global _handle
    if _handle is None:
        import ray

        _handle = ray.remote(num_cpus=0)(AdapterMailbox).options(name=NAME, get_if_exists=True).remote()
    return _handle


def in_process(box: AdapterMailbox):
    """A handle to `box` shaped like the actor's (`.post.remote(...)`, `.take.remote(...)`), without Ray: for
    checks and tests that stand in for mailbox() in one process."""
    method = lambda f: type("Method", (), {"remote": staticmethod(f)})()
    return type("Handle", (), {"post": method(box.post), "take": method(box.take)})()


async def post(meta: dict, tensors: dict, base: dict | None = None) -> int:
    return await mailbox().post.remote(meta, tensors, base)


async def take(delivered: int, timeout_s: float, base_have: int | None = None):
    return await mailbox().take.remote(delivered, timeout_s, base_have)
