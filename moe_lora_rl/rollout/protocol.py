"""The wire of the rollout engine's /generate (server.py and client.py): the request checks both sides run, routes
as base64 of the array's bytes with dtype and shape, and the Sample a client reads back."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    logprobs: list[float]          # one per response token: log_softmax(logits / temperature) of the sampled token
    routes: np.ndarray | None      # [len(prompt)+len(response)-1, n_moe_layers, topk] logical expert ids
    finish_reason: str             # "stop" (a stop id or the model's EOS, included in response) or "length"
    versions: list | None = None   # per response token: the adapter version that produced it (None: base model)
    kv_kept: dict | None = None    # KV replay: the sampler's eviction record (policy/kv_masks.py)


def encode_routes(arr) -> dict:
    import numpy as np

    arr = np.ascontiguousarray(arr)
    return {"b64": base64.b64encode(arr.tobytes()).decode(), "dtype": str(arr.dtype), "shape": list(arr.shape)}


def decode_routes(d: dict | None):
    import numpy as np

    if d is None:
        return None
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def check_request(prompts, seeds, max_tokens, temperature, stop_token_ids) -> None:
    """The checks of a generate call (client and server side): ValueError naming the bad value."""
    if not isinstance(prompts, list) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token id lists, got {prompts!r:.80}")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise ValueError(f"prompts[{i}] is empty or not a list of token ids: {p!r:.80}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            raise ValueError(f"prompts[{i}] has a token id that is not a non-negative int: {p!r:.80}")
    if seeds is not None:
        if not isinstance(seeds, list) or len(seeds) != len(prompts):
            raise ValueError(f"seeds must be one int per prompt ({len(prompts)}), got "
                             f"{len(seeds) if isinstance(seeds, list) else type(seeds).__name__}: {seeds!r:.80}")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ValueError(f"seeds must be ints, got {seeds!r:.80}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (0 <= temperature < 1e4):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r:.80}")


def as_ints(xs):
    """A list of ints from a list / tuple / array of integers (numpy or torch scalars too); anything else unchanged,
    for check_request to name it."""
    import operator

    if xs is None or isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        return xs
    try:
        return [operator.index(x) for x in xs]
    except TypeError:
        return list(xs)


def decode_sample(prompt, s: dict) -> Sample:
    """A sample of /generate's answer (the server's sample_json) for `prompt`."""
    return Sample(prompt, s["response"], s["logprobs"], decode_routes(s["routes"]), s["finish_reason"],
                  s.get("versions"), s.get("kv_kept"))
