"""Routes of prompt tokens kept per full KV block, so requests whose prompt is served from vLLM's prefix cache
still get complete routes (a group of samples of one prompt: the prompt is computed once).

Keyed like vLLM's prefix cache: a hash chained over the prompt's full blocks of token ids, so a cache hit of n
blocks finds the routes of exactly those n * block_size tokens. Routes depend on the served weights too: the
worker extension clears this store whenever it commits a new adapter version (the prefix cache must be reset then
as well, the transports do it). Bounded: least recently used prefixes are dropped beyond `max_blocks` keys.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_keys(tokens: list[int], block_size: int) -> list[bytes]:
    """Chained hash per full block: keys[n - 1] identifies tokens[: n * block_size]."""
    keys, h = [], b""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(len(tokens) // block_size):
        h = hashlib.blake2b(h + arr[n * block_size:(n + 1) * block_size].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixRoutes:
    def __init__(self, runner, max_blocks: int = 1 << 16):
        self.runner = runner
        self.block_size = int(runner.cache_config.block_size)
        self.max_blocks = max_blocks
        self.by_key: OrderedDict[bytes, np.ndarray] = OrderedDict()    # prefix key -> its rows (views)
        self.stored: set[str] = set()
        self.hits = 0

    def _prompt(self, rid: str) -> list[int]:
        state = self.runner.requests.get(rid)
        return list(state.prompt_token_ids or []) if state is not None else []

    def store(self, rid: str, chunks: list[np.ndarray], rows: int) -> None:
        """Called after each step with the request's captured rows; stores its prompt's full blocks once."""
        if rid in self.stored:
            return
        prompt = self._prompt(rid)
        full = len(prompt) // self.block_size * self.block_size
        if full == 0:
            self.stored.add(rid)
            return
        if rows < full:
            return
        self.stored.add(rid)
        routes = np.concatenate(chunks, axis=0)[:full]
        keys = block_keys(prompt[:full], self.block_size)
        for n, key in enumerate(keys, 1):
            self.by_key[key] = routes[: n * self.block_size]
            self.by_key.move_to_end(key)
        while len(self.by_key) > self.max_blocks:
            self.by_key.popitem(last=False)

    def lookup(self, rid: str, have: int, start: int) -> np.ndarray | None:
        """Rows have..start-1 of this request from a stored prompt prefix, or None."""
        if start % self.block_size:
            return None
        prompt = self._prompt(rid)
        if start > len(prompt):
            return None
        keys = block_keys(prompt[:start], self.block_size)
        if not keys or keys[-1] not in self.by_key:
            return None
        self.by_key.move_to_end(keys[-1])
        self.hits += 1
        return self.by_key[keys[-1]][have:start]

    def forget(self, rid: str) -> None:
        self.stored.discard(rid)

    def clear(self) -> None:
        self.by_key.clear()
        self.stored.clear()
