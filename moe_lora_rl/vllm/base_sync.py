"""Full base weights into a running engine through vLLM's own weight-transfer API (vllm/distributed/weight_transfer:
the worker's start_weight_update / update_weights / finish_weight_update), with our backend "moe_lora_shm":
buckets in shared-memory segments (refit/shm.py), each checked against its digest.

    moe_lora_base_init()            (the worker extension) registers the backend with vLLM's factory and creates
                                    this worker's engine: scoped to engines started with our extension
    start_weight_update()           opens an update
    update_weights(info)            one bucket: {version, buckets, index, handle, entries, digest, pieces}; read
                                    from its segment and checked against its digest before anything is kept
    finish_weight_update()          every bucket of the version in: each tensor put together from its pieces and
                                    loaded (vLLM's layerwise reload: the kernels' post-load processing runs again),
                                    then the version serves

The model's weights are written at finish only, from bytes that all passed their digests, so a refused bucket or an
incomplete version changes nothing: the engine keeps its previous weights (or, started with load_format=dummy,
keeps serving nothing: `served` stays None). A version older than the served one is refused. The base comes first:
an update after an adapter was pushed is refused (the adapters' serving state holds references to the base).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

BACKEND = "moe_lora_shm"


@dataclass
class InitInfo:
    """Nothing to agree on: segments are named per bucket."""


@dataclass
class UpdateInfo:
    version: int
    buckets: int
    index: int
    handle: str
    entries: list
    digest: str
    pieces: list = field(default_factory=list)      # [name, dtype, shape, start, nbytes, part, parts] per entry


def available_bytes() -> int | None:
    """The host's available memory (Linux MemAvailable), None where it cannot be read: the engine keeps a private
    copy of each bucket until the version is complete, so a bucket must fit what is left."""
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
            self.timers = {"read_s": 0.0, "load_s": 0.0}
            self._reset()

        def _reset(self):
            self.version, self.expect, self.got = None, None, set()
            self.parts: dict[str, dict] = {}                 # name -> {dtype, shape, chunks: {part: bytes}, parts}

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            self._reset()

        def receive_weights(self, u: UpdateInfo) -> None:
            from ..refit.shm import read_segment

            try:
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
                if len(u.pieces) != len(u.entries):
                    raise ValueError(f"bucket {u.index}: {len(u.pieces)} pieces for {len(u.entries)} entries")
                need, free = sum(int(p[4]) for p in u.pieces), available_bytes()
                if free is not None and need > free:
                    raise ValueError(f"base version {u.version}: bucket {u.index} of {need} bytes is larger than the "
                                     f"engine's free memory ({free} bytes); send smaller buckets "
                                     "(rollout.base_bucket_mb)")
                t0 = time.perf_counter()
                got = read_segment(u.handle, u.entries, u.digest)          # ValueError on a digest mismatch
                for (key, _, _), (name, dtype, shape, start, nbytes, part, parts) in zip(u.entries, u.pieces):
                    t = self.parts.setdefault(name, {"dtype": _dtype(dtype), "shape": tuple(shape), "parts": parts,
                                                      "chunks": {}})
                    if (t["dtype"], t["shape"], t["parts"]) != (_dtype(dtype), tuple(shape), parts) \
                            or part in t["chunks"] or got[key].numel() != nbytes:
                        raise ValueError(f"bucket {u.index}: piece {part} of {name!r} does not match its other "
                                         f"pieces (or repeats one)")
                    t["chunks"][part] = (start, got[key])      # a view of this bucket's private copy
                self.got.add(u.index)
                self.timers["read_s"] += time.perf_counter() - t0
            except BaseException:
                self._reset()                        # the whole version is dropped; the weights were not touched
                raise

        def tensors(self) -> dict[str, torch.Tensor]:
            """The staged tensors, each from its pieces; ValueError naming what is missing."""
            missing = sorted(set(range(self.expect or 0)) - self.got)
            if self.version is None or missing:
                raise ValueError(f"base version {self.version}: buckets {missing[:8]} of {self.expect} never "
                                 "arrived; the version does not serve")
            out = {}
            for name, t in self.parts.items():
                if len(t["chunks"]) != t["parts"]:
                    raise ValueError(f"{name!r}: {len(t['chunks'])} of {t['parts']} pieces arrived")
                flat = torch.empty(torch.Size(t["shape"]).numel() * torch.empty((), dtype=t["dtype"]).element_size(),
                                   dtype=torch.uint8)
                at = 0
                for start, data in sorted(t["chunks"].values(), key=lambda c: c[0]):
                    if start != at:
                        raise ValueError(f"{name!r}: its pieces leave a gap at byte {at}")
                    flat[at:at + data.numel()] = data
                    at += data.numel()
                if at != flat.numel():
                    raise ValueError(f"{name!r}: {at} of {flat.numel()} bytes arrived")
                out[name] = flat.view(t["dtype"]).view(t["shape"])
            return out

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                  initialize_layerwise_reload)

            try:
                weights = self.tensors()
                t0 = time.perf_counter()
                initialize_layerwise_reload(self.model)
                self.model.load_weights(list(weights.items()))
                finalize_layerwise_reload(self.model, self.model_config)
                self.timers["load_s"] += time.perf_counter() - t0
                self.served = self.version
            finally:
                self._reset()

        def shutdown(self) -> None:
            self._reset()

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
