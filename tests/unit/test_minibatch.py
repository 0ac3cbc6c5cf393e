"""PPO mini-batches (pure parts): the rows of each mini-step and its sub-batch (rl/minibatch.py), the metrics of a
rollout batch's mini-steps (rl/trainer_step.py), staleness counted in pushes when a push carries several optimizer steps
(rl/groups.py), and the refusals of algo.mini_batches / algo.epochs (config, preflight, the CLI's one line)."""

import numpy as np
import pytest
import torch

from moe_lora_rl.policy.batch import PolicyBatch
from moe_lora_rl.rl.groups import PushClock, StalenessGate, staleness
from moe_lora_rl.rl.minibatch import mini_batch_rows, select, select_routes
from moe_lora_rl.rl.trainer_step import mini_step_metrics
from moe_lora_rl.router_replay.routes import RoutesBatch

N, S, LAYERS, E, K = 8, 9, (1, 3), 16, 4
LENGTHS = [9, 5, 7, 4, 9, 6, 3, 8]


def _batch() -> PolicyBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(N, S, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = torch.randint(1, 100, (n,), generator=g)
    mask = (torch.arange(S - 1)[None] >= 1) & (torch.arange(S - 1)[None] < torch.tensor(LENGTHS)[:, None] - 1)
    adv = torch.randn(N, S - 1, generator=g) * mask
    rollout = torch.randn(N, S - 1, generator=g) * mask
    rng = np.random.default_rng(0)
    routes = RoutesBatch([np.argsort(rng.random((n - 1, len(LAYERS), E)), -1)[..., :K] for n in LENGTHS],
                         LAYERS, E, K)
    return PolicyBatch(tokens, list(LENGTHS), mask, adv, rollout, routes, [i // 2 for i in range(N)])


def test_mini_batch_rows_are_contiguous_slices():
    assert mini_batch_rows(8, 1) == [list(range(8))]
    assert mini_batch_rows(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mini_batch_rows(12, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match=r"^mini_batches=3 does not divide the batch of 8 rows$"):
        mini_batch_rows(8, 3)
    with pytest.raises(ValueError, match=r"^mini_batches=0 must be an integer >= 1$"):
        mini_batch_rows(8, 0)


def test_select_takes_the_rows_and_their_routes():
    b = _batch()
    rows = [4, 5]
    sub = select(b, rows)
    assert sub.tokens.shape == (2, S) and sub.loss_mask.shape == (2, S - 1)         # sequence length kept
    assert torch.equal(sub.tokens, b.tokens[4:6]) and sub.lengths == [9, 6] and sub.group_ids == [2, 2]
    for name in ("loss_mask", "advantages", "rollout_logprobs"):
        assert torch.equal(getattr(sub, name), getattr(b, name)[4:6]), name
    assert sub.routes.layer_ids == LAYERS and (sub.routes.num_experts, sub.routes.topk) == (E, K)
    assert [r.shape[0] for r in sub.routes.samples] == [8, 5]
    assert all(np.array_equal(x, b.routes.samples[i]) for x, i in zip(sub.routes.samples, rows))
    sub.routes.check_tokens([n - 1 for n in sub.lengths])                          # routes match the sub-batch rows
    # negative control: another slice has other tokens and other routes
    other = select(b, [6, 7])
    assert not torch.equal(other.tokens, sub.tokens)
    assert not any(np.array_equal(x, y) for x, y in zip(other.routes.samples, sub.routes.samples))
    # the rows of the recorded routes (R2), and None staying None
    rec = select_routes(b.routes, [1, 0])
    assert np.array_equal(rec.samples[0], b.routes.samples[1]) and np.array_equal(rec.samples[1], b.routes.samples[0])
    assert select_routes(None, [0]) is None
    nolp = select(PolicyBatch(b.tokens, b.lengths, b.loss_mask, b.advantages, None, None, b.group_ids), [0, 1])
    assert nolp.rollout_logprobs is None and nolp.routes is None
    with pytest.raises(ValueError, match=r"^rows \[7, 8\] must be a non-empty list of row indices in 0..7$"):
        select(b, [7, 8])


def _step(loss, norm, clipfrac, skipped=False, clipped=False, kl=None):
    d = {"loss": loss, "grad_norm": norm, "clipped": clipped, "skipped": skipped, "pg_clipfrac": clipfrac,
         "kl": 0.0, "lr": 1e-3, "rollout_rejected_frac": 0.0}
    if kl is not None:
        d["update_rollout_kl"] = kl
    return d


def test_mini_step_metrics_mean_over_steps_taken():
    steps = [_step(1.0, 2.0, 0.0, kl=1e-12), _step(3.0, 4.0, 0.2, clipped=True, kl=1e-3),
             _step(float("nan"), float("nan"), 0.0, skipped=True), _step(2.0, 3.0, 0.4, kl=2e-3)]
    m = mini_step_metrics(steps)
    assert m["loss"] == pytest.approx(2.0) and m["grad_norm"] == pytest.approx(3.0)       # the skipped one left out
    assert m["pg_clipfrac"] == pytest.approx(0.2) and m["pg_clipfrac_last"] == 0.4 and m["grad_norm_max"] == 4.0
    assert m["clipped"] is True and m["skipped"] is False
    assert (m["mini_steps"], m["mini_steps_skipped"]) == (4, 1)
    assert m["ministep0_rollout_kl"] == 1e-12 and m["ministep_last_rollout_kl"] == 2e-3
    # control: every mini-step skipped -> the step is skipped, its numbers those of the skipped steps (non-finite)
    allskip = mini_step_metrics([_step(float("nan"), float("inf"), 0.0, skipped=True)] * 2)
    assert allskip["skipped"] is True and allskip["mini_steps_skipped"] == 2 and not np.isfinite(allskip["grad_norm"])
    assert "ministep0_rollout_kl" not in allskip


def test_staleness_counts_pushes_not_versions():
    """4 mini-steps per push: versions 0, 4, 8, 12 served. A sample of version 4 trained at version 8 is one push
    old; counted in versions (the control) it would be 4 and dropped at max_staleness=1."""
    clock = PushClock(0)
    for v in (4, 8):
        clock.serve(v)
    assert clock.pushes == 2 and clock.staleness(8, [4, 8]) == 1 and clock.staleness(8, [None, 8]) == 2
    assert staleness(8, [4, 8]) == 4                                    # the control: counted in versions
    clock.serve(8)                                                      # the same version again: no new push
    assert clock.pushes == 2
    with pytest.raises(ValueError, match="served version went back from 8 to 7"):
        clock.serve(7)
    ones = PushClock(5)                                                 # one version per push: as before
    for v in (6, 7):
        ones.serve(v)
    assert ones.staleness(7, [5, 6]) == staleness(7, [5, 6]) == 2 and ones.staleness(7, [3]) == staleness(7, [3])
    gate = StalenessGate(prompts_per_step=2, max_staleness=1, version=0)
    assert [gate.admit() for _ in range(4)] == [0, 0, 1, 1] and not gate.may_admit()
    gate.serve(4)                                                       # one push of 4 steps opens one update
    assert [gate.admit(), gate.admit()] == [2, 2] and not gate.may_admit() and gate.served == 4


def check(overrides, world):
    from moe_lora_rl.rl import config
    from moe_lora_rl.rl.config import preflight

    return preflight.check(config.load(overrides), world)


@pytest.mark.parametrize("overrides, message", [
    (["algo.mini_batches=3"], "algo.mini_batches=3 does not divide the batch group_size*prompts_per_step=64"),
    (["algo.mini_batches=0"], "algo.mini_batches=0 must be an integer >= 1"),
    (["algo.epochs=0"], "algo.epochs=0 must be an integer >= 1"),
    (["algo.epochs=-2"], "algo.epochs=-2 must be an integer >= 1"),
    (["algo.mini_batches=8"], "algo.micro_batch_size=16 does not divide a mini-batch of 8 responses (batch 64 / "
                              "mini_batches=8)"),
])
def test_config_refusals(overrides, message):
    from moe_lora_rl.rl import config

    with pytest.raises(ValueError) as e:
        config.load(overrides)
    assert str(e.value) == message


def test_preflight_refuses_a_mini_batch_that_does_not_split_over_dp():
    from moe_lora_rl.rl import config

    cfg = config.load(["algo.mini_batches=4", "algo.epochs=3"])                 # 16 responses per mini-batch
    assert (cfg.algo.mini_batches, cfg.algo.epochs) == (4, 3)
    check(["algo.mini_batches=4"], 1)                                            # dp 1: 16 = 1 x 16
    with pytest.raises(ValueError) as e:
        check(["algo.mini_batches=4"], 2)                                        # dp 2: 8 rows < micro 16
    assert str(e.value) == ("algo.mini_batches=4: a mini-batch of 16 responses (batch 64 / 4) does not split over "
                            "data-parallel size 2 into microbatches of micro_batch_size=16")
    check(["algo.mini_batches=4", "algo.micro_batch_size=8"], 2)                 # the control: 16 = 2 x 8


def test_cli_one_line_errors(train_cli, monkeypatch):
    for args, world, line in (
            (["algo.epochs=0"], "1", "train: error: algo.epochs=0 must be an integer >= 1"),
            (["algo.mini_batches=4"], "2", "train: error: algo.mini_batches=4: a mini-batch of 16 responses (batch "
                                           "64 / 4) does not split over data-parallel size 2 into microbatches of "
                                           "micro_batch_size=16")):
        monkeypatch.setenv("WORLD_SIZE", world)
        rc, lines, err = train_cli(*args)
        assert rc == 2 and lines == [line], err