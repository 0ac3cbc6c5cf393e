"""Figures of a step's samples and of the checkpoint, for the step records and the summary."""
from __future__ import annotations

import json


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def token_versions(samples) -> list[int]:
    """The adapter versions that produced the samples' tokens (0: the base model); one in a synchronous step."""
    return sorted({0 if v is None else int(v) for s in samples for v in (s.versions or [None])})


def samples_digest(samples) -> str:
    """sha256 of the step's prompts and sampled tokens, in order (equal runs draw equal samples)."""
    import hashlib

    h = hashlib.sha256()
    for smp in samples:
        h.update(json.dumps([list(smp.prompt), list(smp.response)]).encode())
    return h.hexdigest()
