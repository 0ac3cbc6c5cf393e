"""The rendezvous of our checkpoint-engine backend's mailbox delivery: one named Ray actor per job holding the newest
adapter version the trainer posted (header and host tensors, carried by Ray's object store), and a sequence number.

    seq = await post(meta, tensors)                  trainer rank 0, once per sync
    seq, meta, tensors = await take(delivered, t)    each rollout worker: waits (up to t s) for a post newer than
                                                     the one it delivered last, then gets the newest one

A receiver that missed a post gets the newest (versions only move forward); the mailbox keeps one item, so memory
stays at one adapter set. The actor is created by whichever side asks first and lives as long as that process.
"""
from __future__ import annotations

import asyncio

NAME = "moe_lora_adapter_mailbox"


class AdapterMailbox:
    def __init__(self):
        self.seq, self.item = 0, None
        self.cond = asyncio.Condition()

    async def post(self, meta: dict, tensors: dict) -> int:
        async with self.cond:
            self.seq += 1
            self.item = (self.seq, meta, tensors)
            self.cond.notify_all()
            return self.seq

    async def take(self, delivered: int, timeout_s: float):
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.seq > delivered), timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no adapter version posted within {timeout_s:.0f} s after delivery {delivered} "
                                   "(rollout.checkpoint_engine.engine_kwargs.moe_lora.mailbox_timeout_s)") from None
            return self.item


_handle = None


def mailbox():
    """This process's handle (kept: the process that creates the actor owns it, and Ray ends a named actor once
    its owner holds no reference)."""
    global _handle
    if _handle is None:
        import ray

        _handle = ray.remote(num_cpus=0)(AdapterMailbox).options(name=NAME, get_if_exists=True).remote()
    return _handle


async def post(meta: dict, tensors: dict) -> int:
    return await mailbox().post.remote(meta, tensors)


async def take(delivered: int, timeout_s: float):
    return await mailbox().take.remote(delivered, timeout_s)
