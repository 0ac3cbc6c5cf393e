"""Sparse rollouts, the pure parts: the long sort_trace task and its scorer, Sparse-RL's corrections against a
hand computation (rejection, band, truncation, normalisation) with controls, the KV compression checks and the
per-sequence KV arithmetic of the allocator meter."""
import math

import pytest
import torch

from moe_lora_rl.algos import SparseCorrection, sparse_correction
from moe_lora_rl.data.reward import TRACE_SOURCE, compute_score
from moe_lora_rl.data.task import TaskSpec, make_split, trace
from moe_lora_rl.rollout.kv_compression import check_compression, engine_kwargs
from moe_lora_rl.rollout.kv_meter import per_seq_bytes


def test_trace_is_a_selection_sort():
    assert trace((3, 1, 4, 1)) == " 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 |"
    spec = TaskSpec(length=10, kind="sort_trace")
    ev, tr = make_split(spec, "eval"), make_split(spec, "train")
    assert len(ev) == 256 and len(tr) == 50_000 and ev[0].data_source == TRACE_SOURCE
    assert [p.digits for p in ev] == [p.digits for p in make_split(spec, "eval")]        # deterministic
    assert not {tuple(sorted(p.digits)) for p in ev} & {tuple(sorted(p.digits)) for p in tr}
    p = ev[0]
    firsts = [int(line.split("|")[0]) for line in p.answer.split("\n")]
    assert firsts == sorted(p.digits) and p.answer.count("\n") == 9


def test_trace_score_is_exact_match():
    p = make_split(TaskSpec(length=8, kind="sort_trace", n_eval=64), "eval")[0]
    assert compute_score(TRACE_SOURCE, p.answer + "\n", p.answer) == 1.0
    lines = p.answer.split("\n")
    assert compute_score(TRACE_SOURCE, "\n".join(lines[:-1]), p.answer) == 0.0          # a step missing
    assert compute_score(TRACE_SOURCE, p.answer.replace("|", ":", 1), p.answer) == 0.0
    with pytest.raises(ValueError, match="length=5 is outside 8..12"):
        TaskSpec(length=5, kind="sort_trace")
    with pytest.raises(ValueError, match="kind='essay'"):
        TaskSpec(kind="essay")


def test_warm_start_keys_of_the_short_task_unchanged():
    from moe_lora_rl.data.warm_start import WarmStartSpec, default_spec, task_warm_spec

    assert WarmStartSpec().key() == "09ae454a10"
    assert task_warm_spec("wide", TaskSpec()) == default_spec("wide")
    long = task_warm_spec("wide", TaskSpec(length=10, kind="sort_trace"))
    assert long.task.kind == "sort_trace" and long.steps > WarmStartSpec().steps
    assert long.router_lr_scale == 0.0 and long.key() != default_spec("wide").key()


def _by_hand(dense, sparse, mask, s: SparseCorrection):
    B, T = dense.shape
    keep = torch.zeros(B, T, dtype=torch.bool)
    w = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        rho = [math.exp(float(dense[b, t] - sparse[b, t])) for t in range(T)]
        if any(rho[t] < s.veto for t in range(T) if mask[b, t]):
            continue
        for t in range(T):
            if mask[b, t] and s.lower <= rho[t] <= s.upper:
                keep[b, t], w[b, t] = True, min(rho[t], s.upper)
    return keep, w / (w.sum() / keep.sum())


def test_sparse_correction_by_hand():
    g = torch.Generator().manual_seed(0)
    dense = -torch.rand(6, 7, generator=g) * 3
    sparse = dense + torch.randn(6, 7, generator=g) * 0.3
    sparse[1, 2] = dense[1, 2] + 12.0                   # rho = e^-12 < 1e-4: row 1 vetoed whole
    sparse[4, 6] = dense[4, 6] + 12.0                   # ... but on padding: row 4 stays
    mask = torch.ones(6, 7)
    mask[4, 6] = 0
    s = SparseCorrection()
    kept, w, m = sparse_correction(dense, sparse, mask, s)
    want_keep, want_w = _by_hand(dense, sparse, mask, s)
    assert torch.equal(kept.bool(), want_keep) and not kept[1].any() and kept[4].any()
    assert torch.allclose(w.double(), want_w, atol=1e-6)
    assert math.isclose(float(w[kept.bool()].mean()), 1.0, rel_tol=1e-6)               # batch-normalised
    assert m["sparse/seq_rejected_frac"] == pytest.approx(1 / 6)
    assert m["sparse/token_masked_frac"] == pytest.approx(1 - int(want_keep.sum()) / 41)
    assert m["sparse/ratio_min"] == pytest.approx(math.exp(-12), rel=1e-6)


def test_sparse_correction_on_equal_policies_keeps_everything():
    lp = -torch.rand(4, 5) * 2
    kept, w, m = sparse_correction(lp, lp.clone(), torch.ones(4, 5))
    assert kept.all() and torch.allclose(w, torch.ones(4, 5)) and m["sparse/seq_rejected_frac"] == 0.0
    assert m["sparse/ratio_min"] == m["sparse/ratio_max"] == 1.0


def test_sparse_settings_refused():
    for kw, msg in (({"veto": 1.5}, "veto=1.5"), ({"lower": 1.2}, "lower=1.2"), ({"upper": 0.9}, "upper=0.9")):
        with pytest.raises(ValueError, match=msg):
            SparseCorrection(**kw)
    with pytest.raises(ValueError, match=r"share one \[B, T\] shape"):
        sparse_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_compression_checks():
    check_compression("none", 0, 512)
    check_compression("window", 32, 512, {"num_hidden_layers": 4})
    check_compression("snapkv", 96, 512, {"num_hidden_layers": 4}, {"recent": 32, "interval": 8})
    for args, msg in ((("snapkv", 32, 512), r"kv_budget=32 is not above the sinks plus the recent window \(4 \+ 32\)"),
                      (("snapkv", 96, 512, None, {"interval": 0}), "interval=0 is below 1"),
                      (("snapkv", 40, 512, None, {"recent": 8, "sinks": 0, "window": 41}),
                       r"window=41 \(observation window\) is larger than the budget 40"),
                      (("snapkv", 96, 512, None, {"stride": 2}), r"unknown setting\(s\) \['stride'\]"),
                      (("snapkv", 96, 512, None, [4]), r"kv_evict=\[4\] is not a mapping"),
                      (("window", 32, 512, None, {"recent": 8}), "applies to kv_compression=snapkv, not 'window'"),
                      (("snapkv", 96, 512, {"kv_lora_rank": 512}), "MLA"),
                      (("snapkv", 96, 512, {"layer_types": ["full_attention", "sliding_attention"]}),
                       "sliding-window attention layers"),
                      (("window", 600, 512), "kv_budget=600 exceeds"),
                      (("window", 4, 512), "kv_budget=4 is below"), (("none", 32, 512), "kv_budget=32 needs"),
                      (("window", 32, 512, {"kv_lora_rank": 512}), "MLA"),
                      (("window", 32, 512, {"layer_types": ["linear_attention"]}), "non-attention")):
        with pytest.raises(ValueError, match=msg):
            check_compression(*args)
    assert engine_kwargs("none", 0) == {} and engine_kwargs("snapkv", 96) == {}
    over = engine_kwargs("window", 32, {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})
    assert over["hf_overrides"]["sliding_window"] == 32
    assert over["hf_overrides"]["layer_types"] == ["sliding_attention"] * 2


def test_per_seq_bytes():
    a = {"block_steps": 40, "seq_steps": 10, "block_bytes": 1000, "peak_blocks_per_seq": 5.0}
    b = {"block_steps": 100, "seq_steps": 30, "block_bytes": 1000, "peak_blocks_per_seq": 6.0}
    assert per_seq_bytes(a, b) == {"kv_bytes_per_seq": 3000.0, "kv_peak_bytes_per_seq": 6000.0}
    assert per_seq_bytes(None, a)["kv_bytes_per_seq"] == 4000.0


@pytest.mark.parametrize("override,needle", [
    ("rollout.kv_compression=snapkv", "kv_budget=0 is below snapkv's minimum"),
    ("rollout.kv_compression=sparse", "kv_compression='sparse' is not one of"),
    ("rollout.kv_evict.recent=8", "applies to kv_compression=snapkv, not 'none'"),
    ("rollout.kv_evict.stride=8", "unknown config key 'rollout.kv_evict.stride'"),
    ("rollout.kv_budget=32", "kv_budget=32 needs rollout.kv_compression"),
    ("algo.sparse_veto=2", "veto=2"),
    ("algo.sparse_upper=0.8", "upper=0.8"),
    ("algo.rollout_is=sparsity", "algo.rollout_is"),
    ("data.task=essay", "kind='essay'"),
    ("rollout.kv_replay=true", "kv_replay=true replays importance eviction: rollout.kv_compression=none"),
])
def test_train_config_refuses(override, needle):
    from moe_lora_rl.rl import config

    with pytest.raises(ValueError, match=needle):
        config.load([override])
    cfg = config.load(["rollout.kv_compression=window", "rollout.kv_budget=48", "algo.rollout_is=sparse",
                       "data.task=sort_trace", "data.length=10"])
    assert cfg.algo.sparse_settings() == SparseCorrection() and cfg.data.task_spec().kind == "sort_trace"


def test_kv_step_counts_since_the_last_mark_and_survives_a_restart():
    from moe_lora_rl.rl.producer import Producer

    restarted = [{"block_steps": 6, "seq_steps": 2, "block_bytes": 1000, "peak_blocks_per_seq": 3.0,
                  "decode_steps": 2, "decoded_seqs": 10}]
    snaps = iter([[{"block_steps": 40, "seq_steps": 10, "block_bytes": 1000, "peak_blocks_per_seq": 5.0,
                    "decode_steps": 5, "decoded_seqs": 50}],
                  [{"block_steps": 100, "seq_steps": 30, "block_bytes": 1000, "peak_blocks_per_seq": 6.0,
                    "decode_steps": 15, "decoded_seqs": 200}],
                  restarted, restarted])
    prod = Producer.__new__(Producer)
    prod._kv_mark = None
    prod.occ = {}
    prod.kv_snapshot = lambda: next(snaps)
    assert prod.kv_step()["kv_bytes_per_seq"] == 4000.0                 # since the engine started
    assert prod.kv_step() == {"kv_bytes_per_seq": 3000.0, "kv_peak_bytes_per_seq": 6000.0}
    assert prod.kv_step()["kv_bytes_per_seq"] == 3000.0                 # a restarted engine's meter starts over
    # the occupancy over the same windows: 50 + 150 + 10 sequences decoded in 5 + 10 + 2 steps (the restarted
    # engine's counted from its own start); nothing new at the last snapshot
    occ = prod.occupancy()
    assert {k: occ[k] for k in ("engine_occupancy", "engine_steps", "engine_tokens")} == {
        "engine_occupancy": 210 / 17, "engine_steps": 17, "engine_tokens": 210}


def test_engine_step_fit_recovers_a_linear_step_cost_across_windows_and_a_restart():
    """The meter's step sums fit fixed_s + per_seq_s * b; the producer combines them over windows and a restarted
    engine exactly as one meter would (the sums are additive)."""
    from moe_lora_rl.rl.producer import Producer
    from moe_lora_rl.rollout.kv_meter import KVMeter, step_fit

    def meter(batches, fixed=0.004):
        m = KVMeter.__new__(KVMeter)
        m.decode_steps = m.decoded_seqs = m.decoded_sq = 0
        m.decode_s = m.decoded_x_s = 0.0
        m.sched = type("S", (), {"running": []})()
        for b in batches:
            m.sample(b, fixed + 0.0005 * b + (1e-4 if b % 2 else -1e-4))       # noise that averages out
        return {k: getattr(m, k) for k in ("decode_steps", "decoded_seqs", "decoded_sq", "decode_s", "decoded_x_s")}

    first, later, restarted = meter([32, 31, 20, 9, 2, 1]), meter([32, 31, 20, 9, 2, 1, 16, 15]), meter([8, 7], 0.02)
    prod = Producer.__new__(Producer)
    prod._kv_mark, prod.occ = None, {}
    snaps = iter([[first], [later], [restarted], [restarted]])
    prod.kv_snapshot = lambda: next(snaps)
    prod._advance(), prod._advance(), prod._advance()
    fit = prod.occupancy()["engine_step_fit"]
    alone = step_fit({k: later[k] + restarted[k] for k in later})
    assert fit == pytest.approx(alone, rel=1e-12)
    plain = step_fit(later)
    assert plain["fixed_s"] == pytest.approx(0.004, abs=2e-4) and plain["per_seq_s"] == pytest.approx(0.0005, rel=0.05)
    assert step_fit(meter([4, 4, 4])) is None                        # one occupancy: nothing to fit
    # control: the restarted (slower) engine's steps left out would give another fit
    assert plain != pytest.approx(alone, rel=1e-2)
