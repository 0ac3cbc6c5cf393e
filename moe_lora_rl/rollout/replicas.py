"""Several rollout engine processes behind one driver: requests spread over them whole (a GRPO group on one engine,
so its prompt is computed once), every push sent to every engine with one version, and one engine's death known
by its index so that only that engine is restarted.

    engines = Replicas.start(model_dir, placements, **RolloutEngine.start kwargs)      # started side by side
    done = engines.map(lambda i, e: e.generate(...), which=[0, 1], keep=done)         # concurrent; ReplicaDied(i)
    push_stream(model, arch, engines.transport(), version, ...)                        # FanOut: every engine
    engines.restart(i); engines.transport([i])                                          # only the dead one
    spread(n_units, n_engines) -> [[unit indices of engine 0], ...]                     # pure

map keeps what finished in `keep`, so a call repeated after a restart runs only what the dead engine lost.
"""
from __future__ import annotations

import threading

from ..transfer.interface import Transport
from .base import GROUP_TRANSPORTS, base_store_of, broadcast_base
from .client import EngineDied, RolloutEngine


class ReplicaDied(EngineDied):
    """Engine `index` of the replicas is gone (its message and log tail in the text)."""

    def __init__(self, index: int, cause):
        super().__init__(f"engine {index}: {cause}")
        self.index = index

    def __reduce__(self):                # it travels to the other ranks (a push's broadcast of the begin's failure)
        return _replica_died, (self.index, str(self))


def _replica_died(index: int, message: str) -> "ReplicaDied":
    e = ReplicaDied(index, "")
    e.args = (message,)
    return e


def spread(n_units: int, n_engines: int) -> list[list[int]]:
    """Unit k (a group, a held-out problem) on engine k mod n: the same units always on the same engine, and the
    per-sample seeds do not depend on it."""
    if n_engines < 1:
        raise ValueError(f"n_engines={n_engines} must be >= 1")
    return [list(range(i, n_units, n_engines)) for i in range(n_engines)]


def gather(spread_units: list[list[int]], per_engine: dict[int, list], n_units: int) -> list:
    """The results of spread units back in unit order (per_engine[i][j]: the result of unit spread_units[i][j])."""
    out = [None] * n_units
    for i, units in enumerate(spread_units):
        for j, u in enumerate(units):
            out[u] = per_engine[i][j]
    return out


class Replicas:
    def __init__(self, engines: list[RolloutEngine]):
        self.engines = engines
        self.base_store = None               # shared by the engines (base_from=trainer), removed by stop()

    @classmethod
    def start(cls, model_dir, placements, **kw) -> "Replicas":
        """One engine per placement, started side by side (each waits for its own health check); if one fails to
        start, the others are stopped and the error raised. base_transport=gloo|nccl: the base to all of them at once,
        once every one is up."""
        engines = [RolloutEngine(model_dir, placement=p, **kw) for p in placements]
        out = cls(engines)
        synced = kw.get("base_from") in ("trainer", "peer")
        if synced and len(engines) > 1:                                       # one copy of the base for all
            out.base_store = base_store_of(model_dir, engines[0].settings["base_bucket_mb"])
            for e in engines:
                e.base_store, e.owns_base = out.base_store, False
        for e in engines:
            e.peers = lambda: out.engines
        together = synced and len(engines) > 1 and kw.get("base_transport") in GROUP_TRANSPORTS
        try:
            out.map(lambda i, e: e.launch(sync=not together), range(len(engines)), {})
            if together:
                broadcast_base(engines, out.base_store, kw["base_transport"])
        except BaseException:
            out.stop()
            raise
        return out

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> RolloutEngine:
        return self.engines[i]

    def __iter__(self):
        return iter(self.engines)

    def map(self, fn, which, keep: dict) -> dict:
        """keep[i] = fn(i, engine i) for every i in `which` not already in keep, concurrently (inline for one).
        A dead engine raises ReplicaDied(i) once every call has ended (the others' results are kept); another error
        is raised as it is."""
        todo = [i for i in which if i not in keep]
        errors: dict[int, BaseException] = {}

        def one(i):
            try:
                keep[i] = fn(i, self.engines[i])
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors[i] = e

        if len(todo) == 1:
            one(todo[0])
        else:
            threads = [threading.Thread(target=one, args=(i,), name=f"engine-{i}", daemon=True) for i in todo]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        died = sorted(i for i, e in errors.items() if isinstance(e, EngineDied))
        if died:
            raise _as_replica(died[0], errors[died[0]])
        if errors:
            raise errors[min(errors)]
        return keep

    def restart(self, i: int) -> None:
        """A fresh process for engine i (same settings and port); the others keep serving."""
        self.engines[i].restart()

    def transport(self, which=None) -> "FanOut":
        idx = list(range(len(self.engines))) if which is None else list(which)
        return FanOut([(i, self.engines[i].transport) for i in idx])

    def status(self) -> list[dict]:
        return [e.status() for e in self.engines]

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        if self.base_store is not None:
            self.base_store.close()
            self.base_store = None


def _as_replica(i: int, e: BaseException) -> ReplicaDied:
    return e if isinstance(e, ReplicaDied) else ReplicaDied(i, e)


class FanOut:
    """One push to several engines, a Transport (transfer/interface.py) around theirs: each call and each bucket goes
    to every engine in order (call answers with the first engine's answer); a commit must leave every engine serving
    the pushed version. A dead engine is ReplicaDied(its index)."""

    def __init__(self, transports: "list[tuple[int, Transport]]"):
        if not transports:
            raise ValueError("FanOut needs at least one engine transport")
        self.transports = transports

    def _each(self, fn):
        out = []
        for i, t in self.transports:
            try:
                out.append(fn(t))
            except EngineDied as e:
                raise _as_replica(i, e) from e
        return out

    def call(self, method: str, *args):
        out = self._each(lambda t: t.call(method, *args))
        if method == "moe_lora_commit":
            served = {i: r.get("version") if isinstance(r, dict) else r for (i, _), r in zip(self.transports, out)}
            if len(set(served.values())) != 1 or args[0] not in served.values():
                raise RuntimeError(f"version {args[0]} committed, but the engines serve {served}")
        return out[0]

    def send_bucket(self, version: int, index: int, tensors: dict):
        self._each(lambda t: t.send_bucket(version, index, tensors))

    def reset_prefix_cache(self) -> None:
        self._each(lambda t: t.reset_prefix_cache())
