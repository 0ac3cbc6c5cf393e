"""Full base weights into a running engine through vLLM's own weight-transfer API (vllm/distributed/weight_transfer:
the worker's start_weight_update / update_weights / finish_weight_update), with our backend "moe_lora_shm":
buckets in shared-memory segments (transfer/shm.py), each mapped and checked against its digest where it lies,
broadcast to several engines over a gloo group (transfer/gloo_bucket.py: init_weight_transfer_engine joins it) or, on
GPU, an NCCL group (the bucket received into device memory, its digest checked on a host copy), or handed over as a
CUDA IPC handle on the sender's GPU (ipc: copied into the engine's memory, its digest checked on a host copy), or
carried inside the call itself (http: base64 in the RPC's body, for an engine on another host).

    moe_lora_base_init()            (the worker extension) registers the backend with vLLM's factory and creates
                                    this worker's engine: scoped to engines started with our extension
    start_weight_update()           opens an update
    update_weights(info)            one bucket: {version, buckets, index, handle, nbytes, digest, pieces,
                                    transport, data}; its segment mapped read-only (or its broadcast received, or
                                    its inline bytes decoded) and checked against its digest before anything is
                                    kept
    finish_weight_update()          every bucket of the version in: the segments checked again, each tensor taken
                                    where it lies (put together first if it came in pieces) and loaded (vLLM's
                                    layerwise reload: the kernels' post-load processing runs again), then the
                                    version serves

The model's weights are written at finish only, from bytes that all passed their digests, so a refused bucket or an
incomplete version changes nothing: the engine keeps its previous weights (or, started with load_format=dummy,
keeps serving nothing: `served` stays None). At finish the version is first loaded on the meta device
(reload_txn.check_loadable: names, shapes, dtypes, every parameter loaded) and then reloaded as a transaction
(reload_txn.reload: an error inside vLLM's load puts the previous weights back and resets vLLM's layerwise state).
A version older than the served one is refused. The base comes first:
an update after an adapter was pushed is refused (the adapters' serving state holds references to the base).
A new base makes every prefix computed under the old one stale: the worker drops its prefix route store (on_served)
and the engine loop resets vLLM's prefix cache after finish_weight_update, refusing a base update while requests run
(rollout/loop.py BASE_METHODS). With keep (moe_lora_base_init(keep=True)) the version that serves keeps its checkpoint
bytes, and base_export.py gives them to an engine that starts empty (rollout.base_from=peer).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .base_export import PeerExport, SharedExport

BACKEND = "moe_lora_shm"


@dataclass
class InitInfo:
    """Shared memory needs nothing (segments are named per bucket). A gloo broadcast (several engines at once): the
    sender's TCP store and this engine's rank in the group (transfer/gloo_bucket.py)."""
    master_addr: str = ""
    master_port: int = 0
    rank: int = 0
    world_size: int = 0
    timeout_s: float = 120.0
    group_key: str = ""           # the group's rendezvous key (transfer/gloo_bucket.join)
    backend: str = "gloo"         # gloo (host memory) or nccl (this worker's CUDA device)


@dataclass
class UpdateInfo:
    version: int
    buckets: int
    index: int
    handle: str
    nbytes: int
    digest: str
    pieces: list = field(default_factory=list)      # [name, dtype, shape, start, nbytes, part, parts, offset]
    transport: str = "shm"        # shm: the segment `handle`; gloo, nccl: the bytes broadcast over the group;
    #                               http: `data`; ipc: `handle` is a CUDA IPC handle (transfer/cuda_ipc.py)
    data: str = ""                # http: the bucket's bytes, base64


def available_bytes() -> int | None:
    """The host's available memory (Linux MemAvailable), None where it cannot be read: the engine maps each bucket
    until the version is complete and puts the tensors that came in pieces together, so a bucket must fit what is
    left."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _check_no_alias(model, maps) -> None:
    """RuntimeError naming a parameter or buffer whose bytes are still those of a mapped (read-only) segment: the
    loaders must have copied every tensor into the model's own memory before the segments are unmapped."""
    spans = [(m.view.data_ptr(), m.view.data_ptr() + m.total) for m in maps if m.total]
    for name, t in model.state_dict(keep_vars=True).items():
        p = t.untyped_storage().data_ptr() if t.device.type == "cpu" else None
        if p is not None and any(lo <= p < hi for lo, hi in spans):
            raise RuntimeError(f"{name!r} was loaded as a view of a shared-memory segment, not copied")


def engine_class():
    """The backend class (defined on first use: it subclasses vLLM's WeightTransferEngine)."""
    global _ENGINE
    if _ENGINE is not None:
        return _ENGINE
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class ShmBaseEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.served: int | None = None
            self.keep = False                  # keep the served base's checkpoint bytes for a peer (set_keep)
            self.kept: tuple | None = None     # (version, {name: tensor}, the segments they view (index ->
            #                                   (UpdateInfo, MappedSegment)), whether they are the whole version, for
            #                                   a SharedExport)
            self.timers = {"read_s": 0.0, "check_s": 0.0, "snapshot_s": 0.0, "load_s": 0.0}
            self.on_served = None              # called after a new base serves (the worker drops its prefix routes)
            self.touched = time.monotonic()    # the open update's last start or bucket
            self._reset()

        def _reset(self):
            for _, seg in getattr(self, "segs", {}).values():
                seg.close()
            self.version, self.expect, self.got = None, None, set()
            self.segs: dict[int, tuple] = {}     # this version's mapped segments: index -> (UpdateInfo, MappedSegment)
            self.parts: dict[str, dict] = {}                 # name -> {dtype, shape, chunks: {part: bytes}, parts}

        def init_transfer_engine(self, init_info) -> None:
            """A gloo (or nccl) group with the sender and the other engines (an empty master_addr: no group)."""
            from ..transfer.gloo_bucket import join, join_nccl

            self.pg, self.pg_backend = None, None
            if init_info.master_addr:
                if not 0 < init_info.rank < init_info.world_size:
                    raise ValueError(f"{init_info.backend} rank {init_info.rank} of {init_info.world_size}: receivers "
                                     "are ranks 1 .. world_size - 1")
                args = (init_info.master_addr, init_info.master_port, init_info.rank, init_info.world_size,
                        init_info.timeout_s, init_info.group_key)
                if init_info.backend == "nccl":
                    self.pg = join_nccl(*args, device=self.device)
                elif init_info.backend == "gloo":
                    self.pg = join(*args)
                else:
                    raise ValueError(f"group backend {init_info.backend!r}: expected 'gloo' or 'nccl'")
                self.pg_backend = init_info.backend

        def start_weight_update(self) -> None:
            self._reset()
            self.touched = time.monotonic()

        def idle_s(self) -> float:
            """Seconds since the last start_weight_update or bucket."""
            return time.monotonic() - self.touched

        def receive_weights(self, u: UpdateInfo) -> None:
            from ..transfer import gloo_bucket
            from ..transfer.shm import MappedSegment, check_digest, layout_entries
            from ..transfer.inline import decode_inline

            try:
                if u.transport in ("gloo", "nccl"):
                    if getattr(self, "pg", None) is None or self.pg_backend != u.transport:
                        raise ValueError(f"a {u.transport} bucket, but this engine joined no {u.transport} group "
                                         "(init_weight_transfer_engine)")
                    problem = None
                    try:
                        self._check(u)
                    except ValueError as e:
                        problem = e
                    t0 = time.perf_counter()
                    data = gloo_bucket.receive(self.pg, u.nbytes, u.index, problem, lambda b: check_digest(
                        b, layout_entries(u.pieces), u.digest, f"{u.transport} bucket {u.index}"))
                elif u.transport == "http":
                    self._check(u)
                    t0 = time.perf_counter()
                    data = decode_inline(u)              # transfer/inline.py
                elif u.transport == "ipc":
                    from ..transfer.cuda_ipc import open_shared

                    self._check(u)
                    t0 = time.perf_counter()
                    data = open_shared(u.handle, self.device).clone()      # the sender frees its copy after this
                    check_digest(data.cpu(), layout_entries(u.pieces), u.digest, f"ipc bucket {u.index}")
                elif u.transport == "shm":
                    self._check(u)
                    t0 = time.perf_counter()
                    seg = MappedSegment(u.handle, layout_entries(u.pieces), u.digest, u.nbytes,   # checks the digest
                                        keep_fd=self.keep)
                    self.segs[u.index] = (u, seg)
                    data = seg.view
                else:
                    raise ValueError(f"bucket transport {u.transport!r}: expected 'shm', 'gloo', 'nccl', 'ipc' or "
                                     "'http'")
                self._stage(u, data)
                self.touched = time.monotonic()
                self.timers["read_s"] += time.perf_counter() - t0
            except BaseException:
                self._reset()                        # the whole version is dropped; the weights were not touched
                raise

        def _check(self, u: UpdateInfo) -> None:
            """The bucket fits this version and the engine's memory (ValueError naming what does not)."""
            if self.version is None:
                if self.served is not None and u.version <= self.served:
                    raise ValueError(f"base version {u.version}: not newer than the served version {self.served}")
                if u.buckets < 1:
                    raise ValueError(f"base version {u.version}: buckets={u.buckets}")
                self.version, self.expect = u.version, u.buckets
            if (u.version, u.buckets) != (self.version, self.expect):
                raise ValueError(f"bucket of version {u.version} ({u.buckets} buckets) inside the update of "
                                 f"version {self.version} ({self.expect} buckets)")
            if not 0 <= u.index < self.expect or u.index in self.got:
                raise ValueError(f"base version {u.version}: bucket index {u.index} (of {self.expect}) "
                                 f"{'repeated' if u.index in self.got else 'out of range'}")
            for p in u.pieces:
                if len(p) != 8 or not 0 <= int(p[7]) <= int(p[7]) + int(p[4]) <= int(u.nbytes):
                    raise ValueError(f"bucket {u.index}: piece {p[:2]} does not lie inside its {u.nbytes} bytes")
            need = int(u.nbytes)
            free = torch.cuda.mem_get_info(self.device)[0] if u.transport in ("nccl", "ipc") else available_bytes()
            if free is not None and need > free:
                raise ValueError(f"base version {u.version}: bucket {u.index} of {need} bytes is larger than the "
                                 f"engine's free memory ({free} bytes); send smaller buckets "
                                 "(rollout.base_bucket_mb)")

        def _stage(self, u: UpdateInfo, data: torch.Tensor) -> None:
            """The bucket's pieces as views of its checked bytes, for finish."""
            for name, dtype, shape, start, nbytes, part, parts, offset in u.pieces:
                t = self.parts.setdefault(name, {"dtype": _dtype(dtype), "shape": tuple(shape), "parts": parts,
                                                 "chunks": {}})
                if (t["dtype"], t["shape"], t["parts"]) != (_dtype(dtype), tuple(shape), parts) \
                        or part in t["chunks"]:
                    raise ValueError(f"bucket {u.index}: piece {part} of {name!r} does not match its other "
                                     f"pieces (or repeats one)")
                t["chunks"][part] = (start, data[offset:offset + nbytes])    # the bytes where they lie
            self.got.add(u.index)

        def tensors(self) -> dict[str, torch.Tensor]:
            """The staged tensors (views of the mapped segments; put together where they came in pieces);
            ValueError naming what is missing."""
            missing = sorted(set(range(self.expect or 0)) - self.got)
            if self.version is None or missing:
                raise ValueError(f"base version {self.version}: buckets {missing[:8]} of {self.expect} never "
                                 "arrived; the version does not serve")
            out = {}
            for name, t in self.parts.items():
                if len(t["chunks"]) != t["parts"]:
                    raise ValueError(f"{name!r}: {len(t['chunks'])} of {t['parts']} pieces arrived")
                size = torch.Size(t["shape"]).numel() * torch.empty((), dtype=t["dtype"]).element_size()
                chunks = sorted(t["chunks"].values(), key=lambda c: c[0])
                flat = chunks[0][1] if len(chunks) == 1 else torch.empty(size, dtype=torch.uint8,
                                                                         device=chunks[0][1].device)
                at = 0
                for start, data in chunks:
                    if start != at:
                        raise ValueError(f"{name!r}: its pieces leave a gap at byte {at}")
                    if len(chunks) > 1:
                        flat[at:at + data.numel()] = data
                    at += data.numel()
                if at != flat.numel():
                    raise ValueError(f"{name!r}: {at} of {flat.numel()} bytes arrived")
                out[name] = flat.view(t["dtype"]).view(t["shape"])
            return out

        def finish_weight_update(self) -> None:
            from .reload_txn import check_loadable, reload

            try:
                weights = self.tensors()
                t0 = time.perf_counter()
                maps = [seg for _, seg in self.segs.values()]
                for seg in maps:             # the bytes as they were checked on arrival (nothing wrote them since)
                    seg.verify()
                what = f"base version {self.version}"
                check_loadable(self.model, list(weights.items()), what)        # before any weight is touched
                t1 = time.perf_counter()
                self.timers["check_s"] += t1 - t0
                self.timers["snapshot_s"] += reload(
                    self.model, self.model_config, list(weights.items()), lambda: _check_no_alias(self.model, maps))
                self.timers["load_s"] += time.perf_counter() - t1
                self.served = self.version
                self._keep(weights)
                if self.on_served is not None:
                    self.on_served()
            finally:
                self._reset()

        def set_keep(self, keep: bool) -> None:
            """Whether the next version that serves keeps its checkpoint bytes (the kept copy changes only then)."""
            self.keep = bool(keep)

        def _keep(self, weights: dict) -> None:
            """After a version serves: keep its checkpoint bytes (the mappings, taken from this version) when asked
            to, else let them go."""
            self._drop_kept()
            if self.keep:
                whole = len(self.segs) == self.expect and all(seg.fd is not None for _, seg in self.segs.values())
                self.kept, self.segs = (self.served, weights, self.segs, whole), {}

        def _drop_kept(self) -> None:
            kept, self.kept = self.kept, None
            for _, seg in (kept[2].values() if kept else ()):
                seg.close()

        def export(self, bucket_bytes: int) -> PeerExport:
            """The kept base for a peer; ValueError when this engine keeps none."""
            if self.kept is None:
                raise ValueError("this engine keeps no copy of its base to give a peer (it was loaded from disk, "
                                 "never synced, or synced without keep)")
            version, weights, segs, whole = self.kept
            if whole:                       # the segments as they came: a peer on this host maps the same pages
                return SharedExport(version, [segs[i] for i in range(len(segs))])
            return PeerExport(weights, bucket_bytes, version)

        def abort(self) -> None:
            """Drop the open update (the served weights, the kept base and the gloo group stay)."""
            self._reset()

        def shutdown(self) -> None:
            self._reset()
            self.pg = None

    _ENGINE = ShmBaseEngine
    return _ENGINE


_ENGINE = None


def install(worker) -> object:
    """This worker's base-sync engine (created once): our backend registered with vLLM's factory, the engine made as
    vLLM makes the configured one at load time."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    eng = getattr(worker, "weight_transfer_engine", None)
    if eng is not None and type(eng) is engine_class():
        return eng
    if eng is not None:
        raise ValueError(f"this engine already has the weight-transfer backend {type(eng).__name__}")
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND), worker.vllm_config, worker.device, worker.model_runner.get_model())
    return worker.weight_transfer_engine
