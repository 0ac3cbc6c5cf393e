"""The main job's warm start is built by rank 0 while the other ranks wait (rl/run.py setup, megatron/parallel.py
from_rank0): one torchrun launch of 2 ranks (tests/kit/rank0_wait_worker.py) with the process group's
timeout shortened to 5 s and rank 0's model taking 15 s, three times longer.

    slow rank 0      every rank gets rank 0's model path (rank 1 waits 15 s, past the 5 s timeout, and lives)
    failed rank 0    rank 0 raises its own error; rank 1 one line naming it (not a timeout, not a traceback)

Negative control: the same worker on the code before from_rank0 (rank 0 built the warm start before
init_process_group) fails the first case: rank 1 dies in init_process_group after 5 s with DistStoreError.
"""
import pytest

pytestmark = [pytest.mark.dist]

PG_TIMEOUT_S, SLOW_S = 5, 15


@pytest.fixture(scope="module")
def ranks():
    from moe_lora_rl.checks.torchrun import run_torchrun

    rep = run_torchrun("kit.rank0_wait_worker", 2,
                       ["--slow-s", str(SLOW_S), "--pg-timeout-s", str(PG_TIMEOUT_S)], timeout=600)
    return rep["fake_path"], rep["ranks"]


def test_other_ranks_wait_past_the_process_group_timeout(ranks):
    path, by_rank = ranks
    assert set(by_rank) == {"0", "1"}, by_rank
    for r, out in by_rank.items():
        assert out["slow"].get("reached") == path, (r, out["slow"])
    assert by_rank["1"]["slow"]["s"] >= SLOW_S - 1 > PG_TIMEOUT_S          # it did wait longer than the timeout


def test_a_failure_on_rank_0_reaches_the_others_as_one_line(ranks):
    _, by_rank = ranks
    assert by_rank["0"]["failed"] == {"error": "ValueError", "message": "warm start diverged: loss nan at step 3",
                                      "s": by_rank["0"]["failed"]["s"]}
    one = by_rank["1"]["failed"]
    assert one["error"] == "RuntimeError" and "\n" not in one["message"], one
    assert one["message"] == ("rank 0 failed to build the run's model (its warm start): ValueError: warm start "
                              "diverged: loss nan at step 3"), one
