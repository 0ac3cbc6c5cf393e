"""Which adapter versions an engine holds and which request runs on which (pure: no torch, no vLLM).

    track(requests) -> versions      a request's serving version, fixed before vLLM sees it (None: the newest)
    admit(v) -> to_free              a commit of version v: the versions to drop, or ValueError when it does not fit
    release(requests) -> freed       requests ended: versions nobody uses any more are dropped (pin)

Two policies per engine (additional_config "moe_lora_inflight"):
  switch   one version held, the newest; a commit applies to every running request from its next forward
  pin      a running request finishes on the version it was tracked with, new requests get the newest; at most
           `max_versions` (>= 1) adapter versions are held: the newest (it serves every new request, whether or not
           one runs now) and the older versions running requests still use; an older version is freed when its
           last request ends. A commit supersedes the newest, so it frees every held version no request runs on
           (the newest too) and is refused if the versions still in use leave no slot for it (nothing in use is
           ever evicted; max_versions=1: a commit waits for every running request to end). The base model
           (version None) holds no weights of its own and takes no slot.
Several policies on one engine (pin): each commit names its owner (a policy name; None for a run of one policy),
and a commit supersedes only its own owner's newest version: the newest version of every other owner stays held
(it serves that policy's next requests), and the slots (`max_versions`) are shared by all owners. Version numbers
are the engine's, increasing over every commit whatever its owner (the trainer maps each policy's versions to them).
Requests nobody tracked (direct `LLM.generate` callers) run on the newest version. The prefix cache is keyed by
version (`cache_salt`), so a prompt cached under one version never serves another.

A version number is admitted at most once in an engine's life: a clear (moe_lora_clear) serves the base model but
does not forget the numbers passed, and a commit of a number at or below the highest ever admitted is refused,
naming both. Every cache keyed by a version therefore holds one set of weights per key: vLLM's prefix cache
(`cache_salt`, never reset per commit), the prefix route store (prefix_routes.py, same salt), the merged-weight
record (runtime.py `_merged_version`) and the adapter slots (runtime.py `adapters`, `_loras`). A restarted engine
is a new process with empty caches and a new table. The base model's salt (`cache_salt(None)`) is one key across base
syncs (vllm/base_sync.py): a new base empties the caches instead (the engine loop resets vLLM's prefix cache after
finish_weight_update and refuses a base update while requests run; the worker drops its route store), and a base
update once an adapter is served is refused, so no adapter key outlives its base.
"""
from __future__ import annotations

from dataclasses import dataclass

SERVING_MODES = ("unmerged", "merged")
INFLIGHT = ("switch", "pin")
ON_FULL = ("wait", "refuse")
UNTRACKED_SALT = "moe-lora-untracked"


def check_mode(mode) -> str:
    if mode not in SERVING_MODES:
        raise ValueError(f"moe_lora_serving={mode!r}: expected one of {SERVING_MODES}")
    return mode


@dataclass(frozen=True)
class InflightConfig:
    inflight: str = "switch"
    max_versions: int = 1
    on_full: str = "wait"


def check_inflight_config(serving, inflight="switch", max_versions=None, on_full="wait") -> InflightConfig:
    """The engine's version policy with its defaults filled in; ValueError naming the first bad value."""
    check_mode(serving)
    if inflight not in INFLIGHT:
        raise ValueError(f"moe_lora_inflight={inflight!r}: expected one of {INFLIGHT}")
    if on_full not in ON_FULL:
        raise ValueError(f"moe_lora_on_full={on_full!r}: expected one of {ON_FULL}")
    if max_versions is None:
        max_versions = 2 if inflight == "pin" else 1
    if isinstance(max_versions, bool) or not isinstance(max_versions, int) or max_versions < 1:
        raise ValueError(f"moe_lora_max_versions={max_versions!r}: expected an integer >= 1")
    if inflight == "switch" and max_versions != 1:
        raise ValueError(f"moe_lora_max_versions={max_versions}: inflight='switch' holds exactly one version "
                         "(the newest); use inflight='pin' to hold several")
    if inflight == "pin" and serving == "merged":
        raise ValueError("moe_lora_inflight='pin' needs moe_lora_serving='unmerged': merged serving holds one "
                         "version in vLLM's expert weights")
    return InflightConfig(inflight, max_versions, on_full)


def cache_salt(version: int | None) -> str:
    """vLLM's per-request cache_salt for a serving version: prefix-cache blocks are never shared across versions."""
    return "moe-lora-base" if version is None else f"moe-lora-v{version}"


def external_id(internal: str) -> str:
    """The caller's request id of vLLM's internal one (the engine appends '-' and 8 random characters)."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


def _plural(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")


class VersionTable:
    """Held adapter versions (sorted, the newest last) and the version of every tracked request."""

    def __init__(self, config: InflightConfig = InflightConfig()):
        self.config = config
        self.held: list[int] = []
        self.owner: dict[int, str | None] = {}            # held version -> the policy that committed it
        self.requests: dict[str, int | None] = {}         # external request id -> version it was tracked with
        self.passed: int | None = None                     # the highest version ever admitted (clears included)

    @property
    def pin(self) -> bool:
        return self.config.inflight == "pin"

    @property
    def newest(self) -> int | None:
        return self.held[-1] if self.held else None

    def serving(self, request_id: str) -> int | None:
        """The version a tracked request runs on now (switch: the newest); untracked: the newest."""
        if self.pin and request_id in self.requests:
            return self.requests[request_id]
        return self.newest

    def salt_version(self, request_id: str) -> int | None:
        """The version of the request's cache_salt: the one it was tracked with (KeyError if untracked)."""
        return self.requests[request_id]

    def refs(self) -> dict[int | None, int]:
        """Tracked requests per version they run on (None: the base model)."""
        out: dict[int | None, int] = {}
        for rid in self.requests:
            v = self.serving(rid)
            out[v] = out.get(v, 0) + 1
        return out

    # -- requests ------------------------------------------------------------------------------------------
    def track(self, requests) -> list[int | None]:
        """[[request_id, version | None], ...] -> their versions; all or nothing."""
        got, seen = [], set()
        for item in requests:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"moe_lora_track: expected [request_id, version] pairs, got {item!r}")
            rid, v = item
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"moe_lora_track: request id {rid!r} is not a non-empty string")
            if rid in self.requests or rid in seen:
                raise ValueError(f"request {rid} is already tracked")
            seen.add(rid)
            if v is None:
                got.append(self.newest)
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"request {rid}: version {v!r} is not an integer")
            if self.pin and v not in self.held:
                raise ValueError(f"request {rid} pinned to version {v}: the engine holds versions {self.held}")
            if not self.pin and v != self.newest:
                raise ValueError(f"request {rid} asks for version {v}: inflight='switch' serves only the newest "
                                 f"version ({self.newest})")
            got.append(v)
        for (rid, _), v in zip(requests, got):
            self.requests[rid] = v
        return got

    def release(self, request_ids) -> list[int]:
        """Forget ended requests (unknown ids are ignored); returns the versions freed by it."""
        for rid in request_ids:
            self.requests.pop(rid, None)
        return self._drop(self._unused())

    def newest_of(self, owner: str | None) -> int | None:
        """The newest held version committed by `owner`."""
        mine = [v for v in self.held if self.owner.get(v) == owner]
        return mine[-1] if mine else None

    def _newest_per_owner(self, but: object = ...) -> set[int]:
        return {self.newest_of(o) for o in set(self.owner.values()) if o != but}

    def _unused(self) -> list[int]:
        """Held versions a pin engine no longer needs: not an owner's newest and no request on them."""
        if not self.pin:
            return []
        refs, keep = self.refs(), self._newest_per_owner()
        return [v for v in self.held if v not in keep and not refs.get(v)]

    def _superseded(self, owner: str | None = None) -> list[int]:
        """Held versions a commit by `owner` frees: no request on them, `owner`'s newest included (the commit
        replaces it), every other owner's newest kept."""
        refs, keep = self.refs(), self._newest_per_owner(but=owner)
        return [v for v in self.held if v not in keep and not refs.get(v)]

    def _drop(self, versions: list[int]) -> list[int]:
        self.held = [v for v in self.held if v not in versions]
        for v in versions:
            self.owner.pop(v, None)
        return versions

    # -- commits -------------------------------------------------------------------------------------------
    def plan_admit(self, version: int, owner: str | None = None) -> list[int]:
        """The versions a commit of `version` by `owner` frees; ValueError (nothing changed) if it is stale or does
        not fit."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"adapter version must be a non-negative integer, got {version!r}")
        if self.newest is not None and version <= self.newest:
            raise ValueError(f"stale adapter version {version}: version {self.newest} is served")
        self.check_unused(version)
        if owner is not None and not self.pin:
            raise ValueError(f"adapter version {version} of policy {owner!r}: several policies on one engine need "
                             "inflight='pin' (switch holds one version)")
        if not self.pin:
            return list(self.held)
        free = self._superseded(owner)
        keep = [v for v in self.held if v not in free]
        if len(keep) + 1 > self.config.max_versions:
            refs = self.refs()
            used = ", ".join(f"{v} ({'newest, ' if v == self.newest else ''}{_plural(refs.get(v, 0))})"
                             for v in keep)
            raise ValueError(f"cannot commit adapter version {version}: max_versions={self.config.max_versions} and "
                             f"the held versions {used} are in use (an older version is freed when its last "
                             "request ends)")
        return free

    def check_unused(self, version: int) -> None:
        """ValueError unless `version` is above every version this table ever admitted (a number is bound to one
        set of weights for the engine's life: the caches keyed by it never serve other weights)."""
        if self.passed is not None and version <= self.passed:
            raise ValueError(f"adapter version {version} was already passed by this engine (it admitted up to "
                             f"version {self.passed}; a clear does not reset that): a number is never reused, so the "
                             f"caches keyed by it cannot serve other weights; push a version above {self.passed}")

    def snapshot(self) -> tuple:
        """The held versions, owners and highest passed version, for restore() after a failed activation."""
        return list(self.held), dict(self.owner), self.passed

    def restore(self, snap: tuple) -> None:
        held, owner, self.passed = snap
        self.held, self.owner = list(held), dict(owner)

    def admit(self, version: int, owner: str | None = None) -> list[int]:
        """Hold `version` as the newest (of `owner`); returns the versions freed for it."""
        freed = self._drop(self.plan_admit(version, owner))
        self.passed = version if self.passed is None else max(self.passed, version)
        self.held.append(version)
        self.owner[version] = owner
        return freed

    def can_commit(self, owner: str | None = None) -> bool:
        """A commit of a newer version by `owner` fits now (after freeing unused versions)."""
        if not self.pin:
            return True
        return len(self.held) - len(self._superseded(owner)) + 1 <= self.config.max_versions

    def clear(self) -> list[int]:
        """Serve the base model; a pin engine refuses while requests run on a held version."""
        if self.pin:
            refs = self.refs()
            used = [v for v in self.held if refs.get(v)]
            if used:
                raise ValueError(f"cannot clear the adapters: versions {used} are in use by running requests "
                                 "(inflight='pin')")
        return self._drop(list(self.held))

    def status(self) -> dict:
        return {"inflight": self.config.inflight, "max_versions": self.config.max_versions,
                "on_full": self.config.on_full, "versions": list(self.held),
                "requests_per_version": {str(v): n for v, n in self.refs().items()},
                "can_commit": self.can_commit(),
                **({"owners": {str(v): o for v, o in self.owner.items()}}
                   if any(o is not None for o in self.owner.values()) else {})}
