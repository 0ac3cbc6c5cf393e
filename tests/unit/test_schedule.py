"""Prompt order and sample seeds are pure functions of the step: a resumed run draws what an uninterrupted one does."""
import pytest

from moe_lora_rl.rl.schedule import prompt_indices, sample_seed


def test_prompt_stream_epochs_and_resume():
    n, k = 10, 4
    stream = [i for step in range(5) for i in prompt_indices(n, k, step, seed=0)]      # 20 prompts = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]                       # each epoch its own permutation
    # resume: step 3 computed alone equals step 3 of the uninterrupted stream (it spans the epoch boundary)
    assert prompt_indices(n, k, 2, seed=0) == stream[8:12]
    assert prompt_indices(n, k, 2, seed=1) != stream[8:12]    # negative control: another seed, another order
    assert prompt_indices(3, 8, 0, seed=0)[:3] == prompt_indices(3, 1, 0, 0) + prompt_indices(3, 1, 1, 0) + \
        prompt_indices(3, 1, 2, 0)                            # more prompts per step than the split holds


def test_sample_seeds_distinct_and_stable():
    seeds = {sample_seed(0, s, p, j) for s in range(3) for p in range(4) for j in range(8)}
    assert len(seeds) == 96 and all(0 <= x < 2 ** 63 for x in seeds)
    assert sample_seed(0, 1, 2, 3) == sample_seed(0, 1, 2, 3) != sample_seed(1, 1, 2, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="step=-1"):
        prompt_indices(10, 4, -1, 0)
