"""Which prompts a step trains on and the seed of every sample, as pure functions of (seed, step, ...), so that a
resumed run (or a restarted rollout engine) draws exactly the samples an uninterrupted run would.

    prompt_indices(n_train, prompts_per_step, step, seed) -> training-split indices of the step's prompts
    sample_seed(seed, step, prompt_index, sample)          -> the sampling seed of one response
"""
from __future__ import annotations

import functools
import hashlib
import random


@functools.lru_cache(maxsize=4)
def _epoch_order(n_train: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n_train))
    random.Random(f"prompts:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def prompt_indices(n_train: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Step `step` (0-based) takes the next prompts_per_step entries of a stream made of one seeded permutation of
    the training split per epoch: every prompt once per epoch, and no state but the step number."""
    if n_train < 1 or prompts_per_step < 1 or step < 0:
        raise ValueError(f"prompt_indices(n_train={n_train}, prompts_per_step={prompts_per_step}, step={step}): "
                         "need n_train >= 1, prompts_per_step >= 1, step >= 0")
    out: list[int] = []
    pos = step * prompts_per_step
    while len(out) < prompts_per_step:
        epoch, off = divmod(pos, n_train)
        take = min(prompts_per_step - len(out), n_train - off)
        out += _epoch_order(n_train, seed, epoch)[off:off + take]
        pos += take
    return out


def sample_seed(seed: int, step: int, prompt_index: int, sample: int) -> int:
    """A 63-bit sampling seed from (run seed, step, prompt, sample): independent of batch composition and order."""
    digest = hashlib.sha256(f"sample:{seed}:{step}:{prompt_index}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def eval_seed(seed: int, problem_index: int, sample: int = 0) -> int:
    """The sampling seed of one held-out response: the same at every evaluation of a run, so the change between two
    evaluations is the policy's, not the sampler's."""
    digest = hashlib.sha256(f"eval:{seed}:{problem_index}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
