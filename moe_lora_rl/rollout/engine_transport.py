"""The engine client's transports (rollout/client.py's RolloutEngine.transport), each a Transport
(transfer/interface.py) to one engine process: every call first checks the process (a dead engine is EngineDied,
with its exit code and log tail), and the seconds spent count as the engine's push time (busy_s).

    EngineTransport        an engine on this host: buckets in shared-memory segments (transfer's ShmTransport)
    EngineHttpTransport    an engine on another host: each bucket's bytes inside its call (HttpTransport's buckets)
"""
from __future__ import annotations

import time

from ..transfer.interface import RefitError, TransportBase
from ..transfer.transports import HttpTransport, ShmTransport


class EngineTransport(ShmTransport):
    """ShmTransport to the engine process (an engine on this host): push time counts as engine busy time, and a dead
    engine is EngineDied."""

    def __init__(self, engine, base_url: str):                  # engine: client.RolloutEngine
        super().__init__(base_url, timeout=engine.request_timeout, token=engine.token)
        self._engine = engine

    def _timed(self, fn, *args):
        self._engine._check_alive()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except RefitError:
            self._engine._check_alive()
            raise
        finally:
            self._engine.push_s += time.perf_counter() - t0

    def call(self, method: str, *args):
        return self._timed(super().call, method, *args)

    def reset_prefix_cache(self) -> None:
        self._timed(super().reset_prefix_cache)


class EngineHttpTransport(EngineTransport):
    """An engine on another host: the adapter travels inside the RPC (no shared memory across hosts)."""

    def push(self, version, tensors, rank, alpha):
        return TransportBase.push(self, version, tensors, rank, alpha)

    def send_bucket(self, version: int, index: int, tensors: dict):
        HttpTransport.send_bucket(self, version, index, tensors)
