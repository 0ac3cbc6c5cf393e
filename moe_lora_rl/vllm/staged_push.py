"""The staged-push state machine of one engine worker (pure: no torch, no vLLM; used by worker_ext.py).

    idle --begin(v)--> staging v --bucket(v, i)*--> staging v --commit(v)--> idle (the adapter goes to activation)
                                 \\--abort(v)--> idle
                                 \\--expire() after timeout_s without a begin or bucket of v--> idle

At most one version is staged at a time, so a second push while one is in flight is refused with a ValueError that
names both versions, and the served version is untouched. The open stage may be replaced only when
  - the begin is for the same version (its sender restarts the push, e.g. after a lost RPC), or
  - the open stage's sender is gone: it gave its pid at begin (same-host senders) and that process no longer exists, or
  - the open stage expired: no begin or bucket of its version for `timeout_s` seconds (a sender that died without
    giving a pid, e.g. over HTTP from another host),
or after an explicit `abort(version)` of the open stage. Buckets or a commit of any other version are refused and
name the staged one. A commit closes the stage whether or not the activation that follows succeeds.

Expiry is the engine's abort: `expire()` (run periodically by the engine, rollout/server.py) or a begin of another
version drops an expired stage and reports it to `on_expire(stage, idle_s)`; until then the stage is open, and a
late bucket or commit of it still lands (a commit queued behind a busy engine is not an abandoned push). The clock
is injected (time.monotonic by default), so the rule is tested with a fake one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ..procs import pid_alive

# seconds without a begin or bucket after which the engine aborts an open stage: far above the gap between two
# buckets of a legitimate push (one 64 MiB bucket gathered and sent over a slow link), so only abandoned stages expire
DEFAULT_STAGE_TIMEOUT_S = 600.0


def check_stage_timeout(value, name: str = "stage_timeout_s") -> float:
    """The stage timeout as a float; ValueError naming the value unless it is a number > 0 (inf: never expire)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value) and value > 0
    if not ok:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


@dataclass
class Stage:
    version: int
    checksum: str | None
    rank: int
    alpha: float
    num_buckets: int
    sender_pid: int | None = None
    touched: float = 0.0                 # clock reading of the last begin or bucket of this version
    buckets: dict[int, int] = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    owner: str | None = None             # the policy whose version this is (several policies on one engine)


class Staging:
    def __init__(self, alive: Callable[[int], bool] = pid_alive, timeout_s: float = DEFAULT_STAGE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_expire: Callable[[Stage, float], None] | None = None):
        self.stage: Stage | None = None
        self._alive, self._clock, self._on_expire = alive, clock, on_expire
        self.timeout_s = check_stage_timeout(timeout_s)
        self.expired = 0                     # stages the engine aborted for want of progress

    @property
    def version(self) -> int | None:
        return None if self.stage is None else self.stage.version

    def idle_s(self) -> float | None:
        """Seconds since the open stage's last begin or bucket; None when nothing is staged."""
        return None if self.stage is None else self._clock() - self.stage.touched

    def expire(self) -> int | None:
        """Abort the open stage if it had no begin or bucket for timeout_s seconds; its version, else None."""
        st, idle = self.stage, self.idle_s()
        if st is None or idle < self.timeout_s:
            return None
        self.stage = None
        self.expired += 1
        if self._on_expire is not None:
            self._on_expire(st, idle)
        return st.version

    def begin(self, version: int, checksum: str | None, rank: int, alpha: float, num_buckets: int,
              served: int | None = None, sender_pid: int | None = None, owner: str | None = None) -> dict:
        if served is not None and version <= served:
            raise ValueError(f"stale adapter version {version}: version {served} is served")
        if not isinstance(num_buckets, int) or num_buckets < 0:
            raise ValueError(f"version {version}: num_buckets must be an int >= 0, got {num_buckets!r}")
        replaced = None
        st = self.stage
        if st is not None and st.version != version and self.expire() is not None:
            replaced, st = st.version, None
        if st is not None:
            gone = st.sender_pid is not None and not self._alive(st.sender_pid)
            if st.version != version and not gone:
                raise ValueError(f"cannot begin version {version}: version {st.version} is staged and its push is "
                                 f"still in flight (commit it, moe_lora_abort({st.version}) first, or let it expire: "
                                 f"{self.timeout_s:g} s without progress); version {served} stays served")
            replaced = st.version
        self.stage = Stage(version, checksum, rank, alpha, num_buckets, sender_pid, self._clock(), owner=owner)
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
        st.touched = self._clock()
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
