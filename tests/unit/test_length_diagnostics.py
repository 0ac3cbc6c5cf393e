"""The per-step diagnostics that grow with response length (rl/diagnostics.py over mismatch.py and router_replay/disagreement.py), on
batches small enough to work out by hand: per-sequence ratio and log-ratio, KL and free router disagreement per
half of each response, and the control that mirroring every response swaps the halves' figures."""
import math

import numpy as np
import pytest
import torch

from moe_lora_rl.rl.diagnostics import step_diagnostics
from moe_lora_rl.mismatch import halves
from moe_lora_rl.router_replay.disagreement import masked_disagreement, routes_differs
from moe_lora_rl.router_replay.routes import RoutesBatch

# Right-padded rows as rl/batching.py builds them: a response of R tokens after a prompt of P owns label positions
# P-1 .. P+R-2 of the [N, S-1] tensors. Row 0: P=3, R=4 (positions 2..5, halves {2, 3} | {4, 5}); row 1: P=2, R=4
# (positions 1..4, halves {1, 2} | {3, 4}); row 2 (logprob tests only): no response position at all.
SPANS = ((2, 6), (1, 5))
LENGTHS = (7, 6)                        # prompt + response tokens; routes cover every token but the last
WIDTH = 6                               # S - 1
# float64 logprobs, so the hand values hold to rounding (the batch's float32 ones are cast to float64 the same way)
REL = 1e-12


def k3(x: float) -> float:
    return math.expm1(x) - x


def _mask(spans, rows=3) -> torch.Tensor:
    m = torch.zeros((rows, WIDTH), dtype=torch.bool)
    for i, (a, b) in enumerate(spans):
        m[i, a:b] = True
    return m


def _logprobs(deltas: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, rollout): rollout -1.0 everywhere, train = rollout + deltas[(row, position)]."""
    rollout = torch.full((3, WIDTH), -1.0, dtype=torch.float64)
    train = rollout.clone()
    for (i, t), d in deltas.items():
        train[i, t] += d
    return train, rollout


def _mirror(deltas: dict) -> dict:
    """Each response read backwards: position a + j -> b - 1 - j of its span (even lengths: the halves swap)."""
    out = {}
    for (i, t), d in deltas.items():
        if i < len(SPANS):
            a, b = SPANS[i]
            t = a + b - 1 - t
        out[(i, t)] = d
    return out


# row 0: one token at ratio 3 (past 2), in the second half; row 1: ratios 1.4 and 1/1.2 (within 1.5), second half
# too; row 2: a large log ratio at a position outside the mask (no response there), which must count nowhere
DELTAS = {(0, 5): math.log(3.0), (1, 3): math.log(1.4), (1, 4): -math.log(1.2), (2, 0): 5.0}
KL_SECOND = (k3(math.log(3.0)) + k3(0.0) + k3(math.log(1.4)) + k3(-math.log(1.2))) / 4     # {4, 5} and {3, 4}


def test_halves_split_each_row_at_its_midpoint():
    m = torch.tensor([[False, True, True, True, False],          # n = 3: floor(3/2) = 1 in the first half
                      [True, True, True, True, False],           # n = 4: 2 | 2
                      [False, False, False, True, False],        # n = 1: only a second half
                      [False, False, False, False, False]])      # n = 0
    first, second = halves(m)
    assert first.tolist() == [[False, True, False, False, False], [True, True, False, False, False],
                              [False] * 5, [False] * 5]
    assert second.tolist() == [[False, False, True, True, False], [False, False, True, True, False],
                               [False, False, False, True, False], [False] * 5]
    with pytest.raises(ValueError, match="2-D bool"):
        halves(m.long())


def test_sequence_figures_and_kl_per_half():
    train, rollout = _logprobs(DELTAS)
    out = step_diagnostics(rollout, _mask(SPANS), replayed=train, unreplayed=rollout.clone(), disagreement=None)
    assert out["r3_seq_ratio_gt2"] == 0.5            # row 0 (ratio 3) counts, row 1 (<= 1.4) not, row 2 is no sequence
    assert out["r3_seq_log_ratio_max"] == pytest.approx(math.log(3.0), rel=REL)     # row 1: ln(1.4 / 1.2) < ln 3
    assert out["r3_kl_first_half"] == 0.0
    assert out["r3_kl_second_half"] == pytest.approx(KL_SECOND, rel=REL)
    # the logprobs equal to the rollout's: every figure 0
    assert {k: v for k, v in out.items() if k.startswith("no_r3_")} == {
        "no_r3_kl": 0.0, "no_r3_ratio_gt2": 0.0, "no_r3_ratio_gt5": 0.0, "no_r3_seq_ratio_gt2": 0.0,
        "no_r3_seq_log_ratio_max": 0.0, "no_r3_kl_first_half": 0.0, "no_r3_kl_second_half": 0.0,
        "no_r3_ratio_lt_0.5": 0.0, "no_r3_ratio_lt_0.1": 0.0, "no_r3_ratio_lt_0.0001": 0.0}
    assert all(type(v) is float for v in out.values()), {k: type(v) for k, v in out.items()}


def test_sequence_log_ratio_is_the_sum_over_the_sequence():
    # row 1: ln 1.5 + ln 1.5 - ln 1.1 = ln(2.25 / 1.1), larger than row 0's ln 1.9; no single token is past 2
    deltas = {(0, 3): math.log(1.9), (1, 1): math.log(1.5), (1, 4): math.log(1.5), (1, 2): -math.log(1.1)}
    train, rollout = _logprobs(deltas)
    out = step_diagnostics(rollout, _mask(SPANS), replayed=None, unreplayed=train, disagreement=None)
    assert out["no_r3_seq_log_ratio_max"] == pytest.approx(math.log(2.25 / 1.1), rel=REL)
    assert out["no_r3_seq_ratio_gt2"] == 0.0 and out["no_r3_ratio_gt2"] == 0.0
    train[0, 3] = rollout[0, 3] - math.log(40.0)                 # a ratio of 1/40: "either way", and |sum| = ln 40
    out = step_diagnostics(rollout, _mask(SPANS), replayed=None, unreplayed=train, disagreement=None)
    assert out["no_r3_seq_ratio_gt2"] == 0.5
    assert out["no_r3_seq_log_ratio_max"] == pytest.approx(math.log(40.0), rel=REL)
    n = int(_mask(SPANS).sum())                                  # the lower tail: that one token, below 0.5 and 0.1
    assert (out["no_r3_ratio_lt_0.5"], out["no_r3_ratio_lt_0.1"], out["no_r3_ratio_lt_0.0001"]) == (
        pytest.approx(1 / n), pytest.approx(1 / n), 0.0)
    assert "r3_kl" not in out and "r3_seq_ratio_gt2" not in out


def test_mirrored_responses_swap_the_halves():
    """Negative control: the same deltas, each response read backwards, move the KL to the first half; the
    per-sequence figures do not depend on the order and stay."""
    train, rollout = _logprobs(_mirror(DELTAS))
    out = step_diagnostics(rollout, _mask(SPANS), replayed=train, unreplayed=None, disagreement=None)
    assert out["r3_kl_first_half"] == pytest.approx(KL_SECOND, rel=REL)
    assert out["r3_kl_second_half"] == 0.0
    assert out["r3_seq_ratio_gt2"] == 0.5
    assert out["r3_seq_log_ratio_max"] == pytest.approx(math.log(3.0), rel=REL)


def test_a_half_empty_everywhere_reads_zero():
    mask = _mask(((2, 3), (4, 5)), rows=2)                        # responses of one token: no first half anywhere
    train, rollout = (t[:2] for t in _logprobs({(0, 2): math.log(3.0), (1, 4): 0.1}))
    rollout_routes = _rollout_routes()
    free = _free({(0, 2, 1, 0): 7, (1, 4, 0, 1): 7})
    out = step_diagnostics(rollout, mask, replayed=train, unreplayed=train, disagreement=None,
                           free_routes=free, rollout_routes=rollout_routes)
    assert out["r3_kl_first_half"] == 0.0 and out["no_r3_kl_first_half"] == 0.0
    assert out["r3_kl_second_half"] == pytest.approx((k3(math.log(3.0)) + k3(0.1)) / 2, rel=REL)
    assert out["free_disagreement_first_half"] == 0.0 and out["free_token_disagreement_first_half"] == 0.0
    assert out["free_disagreement_second_half"] == 2 / (2 * 2 * 2) and out["free_token_disagreement_second_half"] == 1.0


# routes: 2 MoE layers, top-2 of 8 experts; the rollout picks {0, 1} at every token and layer
def _rollout_routes() -> RoutesBatch:
    return RoutesBatch([np.tile(np.array([0, 1]), (n - 1, 2, 1)) for n in LENGTHS], (1, 3), 8, 2)


def _free(changes: dict) -> RoutesBatch:
    """The rollout's routes with free[sample][token, layer, slot] = expert for each change."""
    samples = [s.copy() for s in _rollout_routes().samples]
    for (i, t, l, k), e in changes.items():
        samples[i][t, l, k] = e
    return RoutesBatch(samples, (1, 3), 8, 2)


# a flip in the prompt (sample 0, token 0: routed, but no response position) and in the second halves only: sample 0
# token 5 one slot, sample 1 token 3 both slots of layer 0; top-k order swapped at sample 0 token 2 (no difference)
ROUTE_CHANGES = {(0, 0, 0, 0): 5, (0, 5, 1, 1): 6, (1, 3, 0, 0): 6, (1, 3, 0, 1): 7, (0, 2, 1, 0): 1, (0, 2, 1, 1): 0}


def test_free_disagreement_per_half():
    mask = _mask(SPANS, rows=2)
    lp = torch.zeros((2, WIDTH))
    out = step_diagnostics(lp, mask, replayed=None, unreplayed=None, disagreement=None,
                           free_routes=_free(ROUTE_CHANGES), rollout_routes=_rollout_routes())
    # second halves: tokens {4, 5} of sample 0 and {3, 4} of sample 1: 4 tokens x 2 layers x top-2
    assert out["free_disagreement_second_half"] == 3 / 16 and out["free_token_disagreement_second_half"] == 2 / 4
    assert out["free_disagreement_first_half"] == 0.0 and out["free_token_disagreement_first_half"] == 0.0
    # the whole-sample figures still count the prompt's flip: 6 + 5 routed tokens
    assert out["free_disagreement"] == 4 / (11 * 4) and out["free_token_disagreement"] == 3 / 11
    assert all(type(v) is float for v in out.values())


def test_mirrored_routes_swap_the_halves():
    """Negative control: the response flips moved to the mirrored positions (sample 0: 5 -> 2, sample 1: 3 -> 2)."""
    moved = {(0, 0, 0, 0): 5, (0, 2, 1, 1): 6, (1, 2, 0, 0): 6, (1, 2, 0, 1): 7}
    out = step_diagnostics(torch.zeros((2, WIDTH)), _mask(SPANS, rows=2), replayed=None, unreplayed=None,
                           disagreement=None, free_routes=_free(moved), rollout_routes=_rollout_routes())
    assert out["free_disagreement_first_half"] == 3 / 16 and out["free_token_disagreement_first_half"] == 2 / 4
    assert out["free_disagreement_second_half"] == 0.0 and out["free_token_disagreement_second_half"] == 0.0


def test_masked_disagreement_refuses_positions_without_routes():
    differs = routes_differs(_free(ROUTE_CHANGES), _rollout_routes())
    assert [tuple(d.shape) for d in differs] == [(6, 2, 2), (5, 2, 2)]
    mask = _mask(((2, 6), (1, 6)), rows=2)                      # sample 1 has routes for tokens 0..4 only
    with pytest.raises(ValueError, match="sample 1: mask selects position 5, beyond its 5 routed tokens"):
        masked_disagreement(differs, mask)
    with pytest.raises(ValueError, match="routes for 2 samples, mask has 3 rows"):
        masked_disagreement(differs, _mask(SPANS))
    with pytest.raises(ValueError, match=r"layers \[1, 3\] top-2 for 2 samples cannot be compared"):
        routes_differs(_rollout_routes(), RoutesBatch(_rollout_routes().samples, (1, 2), 8, 2))
