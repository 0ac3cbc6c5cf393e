"""What our engine's get_per_tensor_param yields: a tensor stream that carries its own header.

    ("moe_lora.meta", uint8 JSON {version, checksum, rank, alpha, base})   first, always
    [base weights of the HF checkpoint, HF names]                          only on a base sync
    (PEFT adapter name, full tensor) ...                                   the adapters, whole on every rank

verl calls get_per_tensor_param(layered_summon, base_sync_done) in its colocated path (with a peft_config back) and
get_per_tensor_param() in checkpoint-engine modes, where peft_config is dropped: there the engine remembers whether
the base went out already, and the header carries version and checksum so the receiver can stage and verify the
adapters without any side channel. The base never trains: a base sync reads it from the checkpoint files.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

META = "moe_lora.meta"


def encode_meta(meta: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(meta, sort_keys=True).encode()), dtype=torch.uint8)


def decode_meta(t: torch.Tensor) -> dict:
    return json.loads(bytes(t.to(torch.uint8).tolist()).decode())


def gather_adapters(model, arch) -> tuple[dict[str, torch.Tensor], str]:
    """Collective: every adapter tensor in PEFT naming on every rank (refit's gather, each bucket broadcast from its
    sender), and the checksum (transfer/wire.py's, over the whole version: the same on every rank)."""
    from ...refit.gather import build_plan, stream_buckets_to_all
    from ...transfer.wire import buffer_crcs, combine, unpack

    got: dict[str, torch.Tensor] = {}
    crcs: dict[str, int] = {}
    for bucket, buf in stream_buckets_to_all(model, build_plan(model, arch, 64 << 20), arch):
        crcs.update(buffer_crcs(buf, bucket.entries()))
        got.update(unpack(buf, bucket.entries()))
        del buf
    return got, combine(crcs)


def base_tensors(path: str):
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {path!r} has no *.safetensors files to sync the base weights from")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                yield name, h.get_tensor(name)


def peft_config(lora, names) -> dict:
    """verl's peft_config for its colocated path (peft_type and task_type as enum members)."""
    from peft import PeftType, TaskType

    modules = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names})
    return {"peft_type": PeftType.LORA, "task_type": TaskType.CAUSAL_LM, "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": modules, "lora_dropout": lora.dropout, "bias": "none"}


def per_tensor_params(engine, base_sync_done: bool | None):
    """(generator, peft_config) on every rank (the gather is collective and runs now); every rank's generator yields
    the same header, base (on a base sync) and adapters."""
    tracking = base_sync_done is None
    send_base = not engine.base_sync_done if tracking else not base_sync_done
    tensors, digest = gather_adapters(engine.model, engine.arch)
    meta = {"version": engine.version, "checksum": digest, "rank": engine.lora.rank, "alpha": engine.lora.alpha,
            "base": bool(send_base)}

    def gen():
        yield META, encode_meta(meta)
        if send_base:
            yield from base_tensors(engine.model_config.local_path)
        yield from tensors.items()

    if tracking:
        engine.base_sync_done = True
    return gen(), (None if tracking else peft_config(engine.lora, tensors))
