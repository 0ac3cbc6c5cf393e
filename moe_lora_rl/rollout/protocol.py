"""The wire of the rollout engine's /generate (server.py and client.py): the request checks both sides run, and
routes as base64 of the array's bytes with dtype and shape."""
from __future__ import annotations

import base64


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
