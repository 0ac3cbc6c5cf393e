"""KV replay's masks (policy/kv_masks.py) on hand-written eviction records: which key each query sees, per layer and
KV head, the query heads of a tensor-parallel rank, and the records refused."""
import pytest
import torch

from moe_lora_rl.policy.kv_masks import batch_masks, check_record, visible

# 2 layers x 2 KV heads; one compression at seq_len 6 with recent 2: layer 0 keeps {0, 2} / {0, 3}, layer 1 {1, 3}
# / {0, 1}; positions 4, 5 are the recent window
RECORD = {"recent": 2, "events": [[6, [[[0, 2], [0, 3]], [[1, 3], [0, 1]]]]]}


def _seen(mask, t):
    return torch.nonzero(mask[t])[:, 0].tolist()


def test_queries_before_the_compression_see_every_earlier_token_and_after_it_the_kept_and_the_recent():
    m = visible(8, RECORD, layers=2, kv_heads=2)
    assert _seen(m[0][0], 5) == [0, 1, 2, 3, 4, 5]                 # query 5 ran before the compression
    assert _seen(m[0][0], 6) == [0, 2, 4, 5, 6]
    assert _seen(m[0][1], 7) == [0, 3, 4, 5, 6, 7]
    assert _seen(m[1][0], 6) == [1, 3, 4, 5, 6]
    assert _seen(m[1][1], 6) == [0, 1, 4, 5, 6]
    dense = visible(8, None, 2, 2)
    assert torch.equal(dense[1][1], torch.ones(8, 8, dtype=torch.bool).tril())
    swapped = visible(8, RECORD, 2, 2, swap=(0, 1, 1, 1, 2))     # layer 1 head 1 keeps 2 instead of 1
    assert _seen(swapped[1][1], 6) == [0, 2, 4, 5, 6] and torch.equal(swapped[0][0], m[0][0])


def test_two_compressions_the_second_replaces_the_first():
    rec = {"recent": 2, "events": [[6, [[[0, 2]]]], [9, [[[0, 5]]]]]}
    m = visible(11, rec, layers=1, kv_heads=1)[0][0]
    assert _seen(m, 8) == [0, 2, 4, 5, 6, 7, 8]
    assert _seen(m, 9) == [0, 5, 7, 8, 9] and _seen(m, 10) == [0, 5, 7, 8, 9, 10]


def test_batch_masks_give_each_query_head_its_kv_heads_mask_on_its_tensor_parallel_rank():
    # 4 query heads over 2 KV heads: heads 0, 1 read KV head 0, heads 2, 3 KV head 1; tp=2, rank 1 holds heads 2, 3
    m = visible(8, RECORD, 2, 2)
    out = batch_masks([RECORD, None], 8, layers=2, heads=4, kv_heads=2, tp_rank=1, tp_size=2)
    assert sorted(out) == [0, 1] and out[0].shape == (2, 2, 8, 8)
    assert torch.equal(out[1][0, 0], ~m[1][1]) and torch.equal(out[1][0, 1], ~m[1][1])     # True = masked
    assert torch.equal(out[0][1, 0], ~torch.ones(8, 8, dtype=torch.bool).tril())            # a dense row: causal
    full = batch_masks([RECORD], 8, 2, 4, 2)
    assert torch.equal(full[0][0, 1], ~m[0][0]) and torch.equal(full[0][0, 2], ~m[0][1])
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        batch_masks([RECORD], 8, 2, 4, 2, 0, 3)


@pytest.mark.parametrize("record, n, match", [
    ({"recent": 2, "events": [[6, [[[0, 2], [0, 3]]]]]}, 8, "has 1 layers"),               # a layer missing
    ({"recent": 2, "events": [[6, [[[0, 2]], [[1, 3]]]]]}, 8, r"\[1\] KV heads"),            # a head missing
    ({"recent": 2, "events": [[6, [[[0, 4], [0, 3]], [[1, 3], [0, 1]]]]]}, 8, "keeps position 4"),  # in the recent
    ({"recent": 2, "events": [[6, [[[0, 2], [0, 3]], [[1, 3], [0, 1]]]]]}, 5, "beyond the row's 5 tokens"),
    ({"recent": 0, "events": []}, 8, "recent=0"),
    ({"events": []}, 8, "must be"),
])
def test_records_that_do_not_fit_the_model_or_the_row_are_refused_with_the_value(record, n, match):
    with pytest.raises(ValueError, match=match):
        check_record(record, n, layers=2, kv_heads=2, row=3)
    check_record(RECORD, 8, 2, 2)


def test_a_preempted_sequence_recomputed_densely_keeps_its_earlier_queries_masks():
    from moe_lora_rl.vllm.kv_select import restart_events

    # compressed at 6 (keeps {0, 2} and the recent 4, 5), preempted, recomputed as a 9-token prefill: the query at 8
    # samples the next token with every earlier token held; queries 6, 7 ran under the compression
    events = restart_events([(6, [[[0, 2]]])], seq_len=9, recent=2, layers=1, kv_heads=1)
    m = visible(11, {"recent": 2, "events": events}, layers=1, kv_heads=1)[0][0]
    assert _seen(m, 7) == [0, 2, 4, 5, 6, 7]
    assert _seen(m, 8) == list(range(9)) and _seen(m, 10) == list(range(11))
    check_record({"recent": 2, "events": events}, 11, 1, 1)
    assert restart_events([], 9, 2, 1, 1) == []                                  # never compressed: still dense
    assert restart_events([(8, [[[0, 2]]])], 9, 2, 1, 1) == []                   # no query ran under it
