"""bench sparse's pure parts: each run's overrides, and every argument honoured or refused before a job starts."""
import pytest

from moe_lora_rl.bench.sparse import main
from moe_lora_rl.bench.runners.sparse_runs import RUNS, mean_of, run_overrides, runs_of, setting_overrides


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
    (["--runs", "sparse_replay"], "--runs='sparse_replay': expected distinct runs of"),
    (["--runs", "dense,dense"], "--runs='dense,dense'"),
    (["--runs", "dense"], "--runs='dense': the summary needs the dense run and a sparse one of every seed"),
    (["--method", "snapkv", "--budget", "48", "--runs", "sparse_replay"], "--runs='sparse_replay': the summary needs"),
])
def test_refused_before_any_run(argv, needle, monkeypatch):
    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        main(argv)


def test_runs_subset_reads_the_others_from_out(tmp_path, monkeypatch):
    """--runs sparse_corrected --reuse: the dense runs are read from --out, only the chosen run starts."""
    import json

    started = []

    def job(nproc, overrides, out, timeout):
        started.append((out.name, [o for o in overrides if o.startswith(("algo.rollout_is", "seed"))]))
        if out.name != "dense-s0":
            raise RuntimeError("stop")
        (out / "summary.json").write_text(json.dumps({"eval_end": 0.5}))
        (out / "metrics.jsonl").write_text("")
        return {"eval_end": 0.5}

    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", job)
    with pytest.raises(ValueError, match="the summary needs the dense run"):        # not in --out, no --out
        main(["--runs", "sparse_corrected,sparse_uncorrected", "--seeds", "0"])
    main(["--runs", "dense", "--seeds", "0", "--out", str(tmp_path)])
    with pytest.raises(RuntimeError, match="stop"):
        main(["--runs", "sparse_corrected", "--seeds", "0", "--out", str(tmp_path), "--reuse"])
    assert started == [("dense-s0", ["seed=0"]), ("sparse_corrected-s0", ["algo.rollout_is=sparse", "seed=0"])]


def test_reuse_reads_only_a_run_of_the_same_overrides(tmp_path, monkeypatch):
    """--reuse refuses, before any run starts, a run in --out made with other overrides (a learning rate, a
    budget) or whose overrides were not recorded: a summary would otherwise mix runs of different settings."""
    def job(nproc, overrides, out, timeout):
        (out / "summary.json").write_text("{}")
        if "dense" not in out.name:
            raise RuntimeError("stop")              # the run is in --out; the summary after it is not this test's
        (out / "metrics.jsonl").write_text("")
        return {}

    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", job)
    with pytest.raises(RuntimeError, match="stop"):
        main(["--runs", "dense,sparse_corrected", "--seeds", "0", "--out", str(tmp_path)])
    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match=r"dense-s0 was run with other overrides \(algo.lr=1e-3 differ\)"):
        main(["--runs", "sparse_uncorrected", "--seeds", "0", "--out", str(tmp_path), "--reuse", "--", "algo.lr=1e-3"])
    with pytest.raises(ValueError, match=r"sparse_corrected-s0 was run .*kv_budget=32, rollout.kv_budget=48 differ"):
        main(["--runs", "sparse_uncorrected", "--seeds", "0", "--out", str(tmp_path), "--reuse", "--budget", "48"])
    (tmp_path / "dense-s0" / "bench_overrides.json").unlink()
    with pytest.raises(ValueError, match="dense-s0 has no bench_overrides.json"):
        main(["--runs", "sparse_corrected", "--seeds", "0", "--out", str(tmp_path), "--reuse"])


def test_runs_too_few_for_a_summary_are_kept_in_out(tmp_path, monkeypatch):
    """--runs dense --out DIR: the dense run alone, reported with the runs still missing; a later --reuse of the
    same DIR with the sparse runs reads it instead of running it again."""
    import json

    started = []

    def job(nproc, overrides, out, timeout):
        started.append(out.name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "kv_peak_bytes_per_seq": 10.0,
                                                       "kv_bytes_per_seq": 8.0}) + "\n")
        summary = {"eval_start": 0.4, "eval_end": 0.5, "eval_end_dense": 0.5, "model": "m", "steps": 1, "evals": {}}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", job)
    out = main(["--runs", "dense", "--seeds", "0", "--out", str(tmp_path)])
    assert started == ["dense-s0"] and out["partial"]
    assert out["done"] == {"dense-s0": {"eval_start": 0.4, "eval_end": 0.5, "eval_end_dense": 0.5}}
    assert out["missing"] == ["sparse_uncorrected-s0", "sparse_corrected-s0"]
    monkeypatch.setattr("moe_lora_rl.bench.sparse.kv_figures", lambda *a: {})
    monkeypatch.setattr("moe_lora_rl.bench.sparse.kv_summary", lambda kv: {})
    out = main(["--runs", "sparse_corrected", "--seeds", "0", "--out", str(tmp_path), "--reuse"])
    assert started == ["dense-s0", "sparse_corrected-s0"] and out["reused"] == ["dense-s0"]
    assert out["runs"] == ["dense", "sparse_corrected"] and "partial" not in out


def test_reuse_needs_out(monkeypatch):
    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match="--reuse reads the runs of --out"):
        main(["--reuse"])


def test_kv_summary_compares_at_the_dense_concurrency():
    from moe_lora_rl.bench.runners.sparse_runs import kv_summary

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


def test_summary_of_a_subset_leaves_the_missing_runs_none(tmp_path, monkeypatch):
    """--runs dense,sparse_replay: the summary's keys of the runs not run are None; the KV ratio is the replay
    run's (the same engine as the corrected run's)."""
    import json

    def job(nproc, overrides, out, timeout):
        replay = "rollout.kv_replay=true" in overrides
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"step": 1, "kv_peak_bytes_per_seq": 40.0 if replay else 100.0, "kv_bytes_per_seq": 30.0 if replay
                 else 60.0, "sparse/seq_rejected_frac": 0.0}]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"eval_start": 0.4, "eval_end": 0.5 if replay else 0.45, "eval_end_dense": 0.55 if replay else None,
                "model": "m", "steps": 1, "evals": {}}

    monkeypatch.setattr("moe_lora_rl.bench.sparse.run_job", job)
    monkeypatch.setattr("moe_lora_rl.bench.sparse.kv_figures", lambda *a: {})
    monkeypatch.setattr("moe_lora_rl.bench.sparse.kv_summary", lambda kv: {})
    monkeypatch.setattr("moe_lora_rl.bench.runners.figures.sparse_png", lambda *a: None)
    out = main(["--method", "snapkv", "--budget", "48", "--runs", "dense,sparse_replay", "--seeds", "0",
                "--out", str(tmp_path)])
    assert out["runs"] == ["dense", "sparse_replay"]
    assert (out["kv_bytes_ratio"], out["kv_bytes_ratio_mean"]) == (0.4, 0.5)
    assert (out["eval_dense"], out["eval_sparse_replay"], out["eval_sparse_replay_sampler"]) == (0.45, 0.55, 0.5)
    assert out["eval_sparse_corrected"] is None and out["rejection_rate"] is None
    assert "sparse_corrected" not in out["kl"]
