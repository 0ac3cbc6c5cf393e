"""The sampler probe's pure parts: the prompt held at a sample's end from the engine's record, and the size buckets."""
import pytest

from kit.sparse_probe import bucket_summary, prompt_held


def test_prompt_held_counts_the_kept_and_the_recent_window():
    # 2 layers x 2 KV heads; a prompt of 8 tokens; the last compression at seq_len 14 with recent 4 (10..13 held)
    rec = {"recent": 4, "events": [[12, [[[0, 1], [0]], [[0], [0]]]],
                                   [14, [[[0, 1, 2, 3, 9], [0, 1]], [[0, 8], [0, 5, 6, 7]]]]]}
    # per head: {0,1,2,3} 4/8, {0,1} 2/8, {0} 1/8 (8 is an answer token), {0,5,6,7} 4/8 -> mean 11/32
    assert prompt_held(rec, prompt_len=8, total=20) == pytest.approx(11 / 32)
    rec_late = {"recent": 4, "events": [[10, [[[0], [0]], [[0], [0]]]]]}       # the recent window 6..9 reaches it
    assert prompt_held(rec_late, prompt_len=8, total=20) == pytest.approx(3 / 8)   # {0, 6, 7}
    assert prompt_held({"recent": 4, "events": []}, 8, 20) is None             # never compressed


def test_buckets_by_size_with_successes_and_failures_apart():
    rows = [{"size": 8, "ok": True, "tokens": 60, "held": 0.5}, {"size": 10, "ok": False, "tokens": 100, "held": 0.1},
            {"size": 14, "ok": False, "tokens": 300, "held": None}, {"size": 25, "ok": True, "tokens": 400, "held": 0.2}]
    out = bucket_summary(rows, [8, 11, 14, 18, 22])
    assert [b["sizes"] for b in out] == ["8-10", "14-17", "22+"]                   # empty buckets left out
    assert (out[0]["samples"], out[0]["success"], out[0]["tokens"]) == (2, 0.5, 80.0)
    assert (out[0]["prompt_held_ok"], out[0]["prompt_held_fail"]) == (0.5, 0.1)
    assert out[1]["prompt_held_fail"] is None and out[2]["success"] == 1.0
