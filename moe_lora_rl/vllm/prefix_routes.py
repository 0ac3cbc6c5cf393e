"""Routes of prompt tokens kept per full KV block, so requests whose prompt is served from vLLM's prefix cache
still get complete routes (a group of samples of one prompt: the prompt is computed once).

Keyed like vLLM's prefix cache: a hash chained over the prompt's full blocks of token ids, seeded with the
request's cache salt, so a cache hit of n blocks finds the routes of exactly those n * block_size tokens computed
under the same adapter version. Routes depend on the served weights: requests tracked by the LoRA runtime carry
their version's salt (versions.cache_salt, the salt the engine loop gives vLLM), requests nobody tracked one fixed
salt. At each commit the worker extension drops the entries of versions no longer held and the untracked ones (the
prefix cache of untracked requests must be reset then as well, the transports do it); entries of versions still
held stay, for the pinned requests that prefill later. Bounded: least recently used prefixes are dropped beyond
`max_blocks` keys.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import numpy as np

from .versions import UNTRACKED_SALT


def block_keys(tokens: list[int], block_size: int, salt: str = "") -> list[bytes]:
    """Chained hash per full block, seeded with the salt: keys[n - 1] identifies (salt, tokens[: n * block_size])."""
    keys, h = [], salt.encode()
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(len(tokens) // block_size):
        h = hashlib.blake2b(h + arr[n * block_size:(n + 1) * block_size].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixRoutes:
    def __init__(self, runner, max_blocks: int = 1 << 16, salt_of: Callable[[str], str] | None = None):
        """salt_of: vLLM's internal request id -> its cache salt (default: every request untracked)."""
        self.runner = runner
        self.block_size = int(runner.cache_config.block_size)
        self.max_blocks = max_blocks
        self.salt_of = salt_of or (lambda rid: UNTRACKED_SALT)
        self.by_key: OrderedDict[bytes, tuple[str, np.ndarray]] = OrderedDict()   # key -> (salt, its rows: views)
        self.stored: dict[str, str] = {}                                           # request -> salt it stored under
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
        salt = self.salt_of(rid)
        if full == 0:
            self.stored[rid] = salt
            return
        if rows < full:
            return
        self.stored[rid] = salt
        routes = np.concatenate(chunks, axis=0)[:full]
        keys = block_keys(prompt[:full], self.block_size, salt)
        for n, key in enumerate(keys, 1):
            self.by_key[key] = (salt, routes[: n * self.block_size])
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
        keys = block_keys(prompt[:start], self.block_size, self.salt_of(rid))
        if not keys or keys[-1] not in self.by_key:
            return None
        self.by_key.move_to_end(keys[-1])
        self.hits += 1
        return self.by_key[keys[-1]][1][have:start]

    def forget(self, rid: str) -> None:
        self.stored.pop(rid, None)

    def clear(self, keep_salts=frozenset()) -> None:
        """Drop every entry (and every request's stored mark) whose salt is not in keep_salts."""
        keep = set(keep_salts)
        for key in [k for k, (salt, _) in self.by_key.items() if salt not in keep]:
            del self.by_key[key]
        for rid in [r for r, salt in self.stored.items() if salt not in keep]:
            del self.stored[rid]
