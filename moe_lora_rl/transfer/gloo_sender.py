"""The base to several engines at once: one gloo process group (CPU; rank 0 this process, rank i + 1 engine i),
each bucket of a BaseStore (base_store.py) broadcast to every engine through vLLM's weight-transfer calls, with an
agreement before and after each bucket (transfer/gloo_bucket.py): a bucket one engine refuses is refused by all, the
engines keep the weights they had, and nobody waits for a broadcast that will not come.

    with GlooBroadcast([engine.transport.call for engine in engines]) as b:   # every engine joins the group
        timers = b.send(store)                                                # start, bucket i ..., finish

Engines of one worker each (the group has one rank per engine). The engines' calls block until the broadcast
reaches them, so each engine's call runs in its own thread while this one broadcasts.

backend="nccl" (GPU engines, this process on a CUDA device): the same protocol over an NCCL group
(transfer/gloo_bucket.join_nccl), each bucket copied to this process's device and broadcast from there. Written against
vLLM's PyNcclCommunicator; refused without CUDA, and not run on the CPU machines that test this project.
"""
from __future__ import annotations

import secrets
import threading
import time

from . import gloo_bucket
from .base_store import BaseStore


class GlooBroadcast:
    def __init__(self, rpcs: list, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 120.0,
                 keep: bool = False, backend: str = "gloo"):
        import torch

        from ..procs import free_port

        if not rpcs:
            raise ValueError(f"a {backend} broadcast needs at least one engine")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: expected 'gloo' or 'nccl'")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("base_transport='nccl' needs CUDA in this process (the broadcast's rank 0); it has none "
                             "(use gloo on CPU)")
        self.rpcs, self.keep, self.backend = list(rpcs), keep, backend
        self.world = len(self.rpcs) + 1
        port = port or free_port()
        key = secrets.token_hex(16)             # the group's rendezvous key, handed over the authenticated RPC

        def join(i, rpc):
            rpc("moe_lora_base_init", bool(keep))
            rpc("init_weight_transfer_engine", {"master_addr": host, "master_port": port, "rank": i + 1,
                                                "world_size": self.world, "timeout_s": timeout_s, "group_key": key,
                                                "backend": backend})

        t0 = time.perf_counter()
        box: dict = {}

        def join_as_sender():
            try:
                if backend == "nccl":
                    box["pg"] = gloo_bucket.join_nccl(host, port, 0, self.world, timeout_s, key,
                                                      device=torch.device("cuda", torch.cuda.current_device()))
                else:
                    box["pg"] = gloo_bucket.join(host, port, 0, self.world, timeout_s, key)
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                box["error"] = e

        sender = threading.Thread(target=join_as_sender, name="gloo-sender-join", daemon=True)
        sender.start()
        threads = self._start(join)
        while sender.is_alive():                # an engine that fails to join fails the group now, not at its timeout
            failed = [t for t in threads if not t.is_alive() and t.errors]
            if failed:
                raise failed[0].errors[0]
            sender.join(0.05)
        self._join(threads)
        if "error" in box:
            raise box["error"]
        self.pg = box["pg"]
        self.init_s = time.perf_counter() - t0

    def _start(self, fn, *args) -> list:
        threads = []
        for i, rpc in enumerate(self.rpcs):
            t = threading.Thread(target=self._guard, args=(fn, i, rpc, *args), name=f"gloo-engine-{i}", daemon=True)
            t.errors = []
            threads.append(t)
            t.start()
        return threads

    @staticmethod
    def _guard(fn, i, rpc, *args):
        try:
            fn(i, rpc, *args)
        except BaseException as e:  # noqa: BLE001 - raised by _join in the caller's thread
            threading.current_thread().errors.append(e)

    @staticmethod
    def _join(threads) -> None:
        for t in threads:
            t.join()
        for t in threads:
            if t.errors:
                raise t.errors[0]

    def _all(self, method: str) -> None:
        self._join(self._start(lambda i, rpc: rpc(method)))

    def send(self, store: BaseStore) -> dict:
        """Every bucket of the store to every engine as its version; the timers (copy: the store's writes during
        this send; transport: the broadcasts with their agreements; load: the engines' finish)."""
        n = len(store.buckets)
        written_s = store.write_s
        timers = {"buckets": n, "bytes": store.nbytes, "engines": len(self.rpcs), "transport_s": 0.0}
        t_all = time.perf_counter()
        try:
            self._all("start_weight_update")
            for i in range(n):
                info = {**store.info(i), "handle": "", "transport": self.backend}
                data = store.data(i)
                threads = self._start(lambda _, rpc: rpc("update_weights", info))
                t0 = time.perf_counter()
                try:
                    gloo_bucket.send(self.pg, data, i)
                finally:
                    self._join(threads)                # an engine's own refusal is the error to raise
                timers["transport_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            timers["move_s"] = t0 - t_all
            self._all("finish_weight_update")
            timers["load_s"] = time.perf_counter() - t0
        except BaseException:
            try:
                self._all("moe_lora_base_abort")
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        timers["copy_s"] = store.write_s - written_s
        timers["total_s"] = time.perf_counter() - t_all
        return timers

    def close(self) -> None:
        """The engines leave the group (their transfer engines shut down); idempotent."""
        if self.pg is None:
            return
        self.pg = None
        try:
            self._all("shutdown_weight_transfer_engine")
        except Exception:  # noqa: BLE001 - an engine that died has left already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
