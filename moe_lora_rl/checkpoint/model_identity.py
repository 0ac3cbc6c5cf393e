"""The base model's identity in a checkpoint's run_meta: what it is, not where it lies.

A resumed run may read the same model from another path (another output folder holding its own copy, a moved
model, another node's mount), and a different model may lie at the same path. So a checkpoint records the model by
content and a load compares only that:

    config_sha256   sha256 of config.json
    weights_digest  sha256 over the weight files (*.safetensors, *.bin, *.pt), sorted by name: each file's name and
                    size, then the whole file when it is at most WHOLE_FILE_BYTES, else three SAMPLE_BYTES chunks
                    (start, middle, end). A safetensors file's start is its header: every tensor's name, dtype, shape
                    and offsets. Reading 3 MiB per file keeps a 1T-parameter checkpoint (~2 TB in ~60 files) to
                    ~200 MB read; any fine-tune of the same architecture changes the sampled bytes.

The resolved path is recorded beside them (`path`, shown in a refusal) and never compared.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from .directory import sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
WHOLE_FILE_BYTES = 16 << 20
SAMPLE_BYTES = 1 << 20
IDENTITY_KEYS = ("config_sha256", "weights_digest")
"""The model keys a load compares (a checkpoint missing one, written before it existed, is compared on the rest)."""


def weights_digest(model_dir: Path) -> str:
    """sha256 (hex) of the weight files under model_dir (top level), as the module docstring says; a folder with no
    weight file has the digest of nothing."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        if size <= WHOLE_FILE_BYTES:
            h.update(bytes.fromhex(sha256_file(f)))
            continue
        with open(f, "rb") as fh:
            for at in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
                fh.seek(at)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(model_path) -> dict:
    """{"path": resolved path (recorded only), "config_sha256", "weights_digest"}. ValueError: no config.json."""
    path = Path(model_path).resolve()
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model path {str(model_path)!r} has no config.json")
    return {"path": str(path), "config_sha256": sha256_file(cfg), "weights_digest": weights_digest(path)}


def check_same_model(saved: dict, current: dict, where: str) -> None:
    """Refuse (ValueError naming the differing key, both values and both paths) when the identities differ."""
    for k in IDENTITY_KEYS:
        if k in saved and k in current and saved[k] != current[k]:
            raise ValueError(f"{where}: checkpoint of another model: {k} {saved[k]!r} (saved from "
                             f"{saved.get('path')!r}), this run has {current[k]!r} ({current.get('path')!r})")
    if not any(k in saved and k in current for k in IDENTITY_KEYS):
        raise ValueError(f"{where}: the checkpoint's run_meta names its model without any of {IDENTITY_KEYS}")
