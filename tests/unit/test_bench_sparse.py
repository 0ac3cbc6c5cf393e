"""bench sparse's pure parts: each run's overrides, and every argument honoured or refused before a job starts."""
import pytest

from moe_lora_rl.bench.sparse import RUNS, main, mean_of, run_overrides, runs_of, setting_overrides


def test_runs_differ_only_in_the_engine_and_the_correction():
    assert run_overrides("dense", "window", 32) == []
    assert run_overrides("sparse_uncorrected", "window", 32) == ["rollout.kv_compression=window",
                                                                 "rollout.kv_budget=32", "algo.rollout_is=off"]
    assert run_overrides("sparse_corrected", "window", 48)[-1] == "algo.rollout_is=sparse"
    assert run_overrides("sparse_uncorrected", "snapkv", 32, {"recent": 8, "interval": 8}) == [
        "rollout.kv_compression=snapkv", "rollout.kv_budget=32", "rollout.kv_evict.interval=8",
        "rollout.kv_evict.recent=8", "algo.rollout_is=off"]
    assert run_overrides("sparse_replay", "snapkv", 48)[-2:] == ["rollout.kv_replay=true", "algo.rollout_is=sparse"]
    assert RUNS == ("dense", "sparse_uncorrected", "sparse_corrected", "sparse_replay")
    assert runs_of("window") == RUNS[:3] and runs_of("snapkv") == RUNS          # a window is not replayed
    assert mean_of([{"a": 1.0}, {"b": 2}, {"a": 3.0}], "a") == 2.0 and mean_of([], "a") is None


def test_the_long_setting_starts_where_grpo_learns_unless_the_model_is_given():
    assert setting_overrides("long", [], [])[-2:] == ["algo.lr=3e-4", "model.warm_steps=500"]
    assert "model.warm_steps=500" not in setting_overrides("long", [], ["model.path=/m"])
    assert "model.warm_steps=500" not in setting_overrides("long", ["model.warm_start=false"], [])
    assert not any(o.startswith("model.") for o in setting_overrides("sort_trace", [], []))


@pytest.mark.parametrize("argv,needle", [
    (["--", "rollout.kv_budget=8"], "override 'rollout.kv_budget=8': sparse sets"),
    (["--", "algo.rollout_is=token"], "override 'algo.rollout_is=token': sparse sets"),
    (["--", "seed=3"], "override 'seed=3': sparse sets"),
    (["--method", "none"], "--method='none'"),
    (["--method", "snapkv"], "kv_budget=32 is not above the sinks plus the recent window"),
    (["--method", "snapkv", "--budget", "48", "--evict", "interval=0"], "interval=0 is below 1"),
    (["--method", "snapkv", "--budget", "48", "--evict", "recent=16,stride=2"], "stride"),
    (["--method", "snapkv", "--evict", "recent=x"], "--evict item 'recent=x': expected key=integer"),
    (["--evict", "recent=16"], "--evict='recent=16' applies to --method snapkv, not 'window'"),
    (["--setting", "essay"], "--setting='essay'"),
    (["--", "rollout.kv_evict.recent=8"], "override 'rollout.kv_evict.recent=8': sparse sets"),
    (["--budget", "4"], "kv_budget=4 is below"),
    (["--budget", "4096"], "kv_budget=4096 exceeds"),
    (["--seeds", "1,1"], "--seeds='1,1'"),
    (["--pool-blocks", "2"], "--pool-blocks=2"),
    (["--kv-requests", "0"], "--kv-requests=0"),
    (["--kv-only", "--reuse", "--out", "x"], "--kv-only runs no learning run"),
    (["--", "algo.sparse_lower=1.2"], "lower=1.2"),
    (["--", "rollout.kv_replay=true"], "override 'rollout.kv_replay=true': sparse sets"),
    (["--setting", "long", "--", "model.warm_steps=0"], "model.warm_steps=0 must be an integer >= 1"),
])
def test_refused_before_any_run(argv, needle, monkeypatch):
    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        main(argv)


def test_reuse_needs_out(monkeypatch):
    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match="--reuse reads the runs of --out"):
        main(["--reuse"])


def test_kv_summary_compares_at_the_dense_concurrency():
    from moe_lora_rl.bench.sparse import kv_summary

    run = lambda cap, mean, peak: {"cap": cap, "blocks_per_seq_mean": mean, "blocks_per_seq_peak": peak,
                                   "tokens_per_s": 100.0}
    dense = {"concurrency": 4, "pool_blocks": 64, "at_concurrency": run(4, 10.0, 14.0), "at_cap": None,
             "kv": {"peak_blocks_per_seq": 14.0}}
    sparse = {"concurrency": 10, "pool_blocks": 64, "at_concurrency": run(10, 4.0, 6.0), "at_cap": run(4, 3.5, 5.0),
              "kv": {"peak_blocks_per_seq": 6.0}, "evictions": {"compressions": 3}}
    out = kv_summary({"none": dense, "sparse": sparse})
    assert out["concurrency_ratio"] == 2.5
    same = out["same_concurrency"]
    assert (same["cap"], same["mean_ratio"], same["peak_ratio"]) == (4, 0.35, 5.0 / 14.0)
    assert out["evictions"] == {"compressions": 3}
