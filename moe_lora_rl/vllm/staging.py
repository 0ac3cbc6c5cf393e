"""The staged-push state machine of one engine worker (pure: no torch, no vLLM; used by worker_ext).

    idle --begin(v)--> staging v --bucket(v, i)*--> staging v --commit(v)--> idle (the adapter goes to activation)
                                 \\--abort(v)--> idle

At most one version is staged at a time, so a second push while one is in flight is refused with a ValueError that
names both versions, and the served version is untouched. The open stage may be replaced only when
  - the begin is for the same version (its sender restarts the push, e.g. after a lost RPC), or
  - the open stage's sender is gone: it gave its pid at begin (same-host senders) and that process no longer exists,
or after an explicit `abort(version)` of the open stage. Buckets or a commit of any other version are refused and
name the staged one. A commit closes the stage whether or not the activation that follows succeeds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..procs import pid_alive


@dataclass
class Stage:
    version: int
    checksum: str | None
    rank: int
    alpha: float
    num_buckets: int
    sender_pid: int | None = None
    buckets: dict[int, int] = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)


class Staging:
    def __init__(self, alive: Callable[[int], bool] = pid_alive):
        self.stage: Stage | None = None
        self._alive = alive

    @property
    def version(self) -> int | None:
        return None if self.stage is None else self.stage.version

    def begin(self, version: int, checksum: str | None, rank: int, alpha: float, num_buckets: int,
              served: int | None = None, sender_pid: int | None = None) -> dict:
        if served is not None and version <= served:
            raise ValueError(f"stale adapter version {version}: version {served} is served")
        if not isinstance(num_buckets, int) or num_buckets < 0:
            raise ValueError(f"version {version}: num_buckets must be an int >= 0, got {num_buckets!r}")
        replaced = None
        st = self.stage
        if st is not None:
            gone = st.sender_pid is not None and not self._alive(st.sender_pid)
            if st.version != version and not gone:
                raise ValueError(f"cannot begin version {version}: version {st.version} is staged and its push is "
                                 f"still in flight (commit it, or moe_lora_abort({st.version}) first); "
                                 f"version {served} stays served")
            replaced = st.version
        self.stage = Stage(version, checksum, rank, alpha, num_buckets, sender_pid)
        return {"staging": version, "replaced": replaced}

    def _open(self, what: str, version: int) -> Stage:
        st = self.stage
        if st is None:
            raise ValueError(f"{what} of version {version}: no version is staged (begin first)")
        if st.version != version:
            raise ValueError(f"{what} of version {version}: version {st.version} is staged")
        return st

    def bucket(self, version: int, index: int, tensors: dict) -> dict:
        st = self._open(f"bucket {index}", version)
        if index in st.buckets or not 0 <= index < st.num_buckets:
            raise ValueError(f"version {version}: bucket index {index} repeated or out of range "
                             f"0..{st.num_buckets - 1}")
        dup = set(tensors) & set(st.tensors)
        if dup:
            raise ValueError(f"version {version}: tensors sent twice: {sorted(dup)[:4]}")
        st.buckets[index] = len(tensors)
        st.tensors.update(tensors)
        return {"received": len(st.buckets)}

    def commit(self, version: int, checksum: str | None = None) -> Stage:
        """Close the stage and return it complete; a refused commit of another version leaves the stage open."""
        st = self._open("commit", version)
        self.stage = None
        if checksum is not None:
            st.checksum = checksum
        if st.checksum is None:
            raise ValueError(f"version {version}: no checksum given at begin or commit")
        if len(st.buckets) != st.num_buckets:
            missing = sorted(set(range(st.num_buckets)) - set(st.buckets))
            raise ValueError(f"version {version}: buckets {missing} never arrived")
        return st

    def abort(self, version: int) -> dict:
        """Drop the staged version (its sender gave up); aborting a version that is not staged is an error naming
        the staged one, so a late abort cannot drop a newer push."""
        self._open("abort", version)
        self.stage = None
        return {"aborted": version}
