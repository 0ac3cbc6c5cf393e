"""bench async without launching jobs: the runs it asks for (sync at each --sync-nproc, the best one again pinned to
one core, async; sync and async again per further seed), the overrides each gets, and its figures computed from the
jobs' summaries (rates without evaluation seconds, phases, the overlap bound, the planner's prediction)."""
import json

import pytest

from moe_lora_rl.bench import async_rl
from moe_lora_rl.bench.runners import plan_model


def summary(steps, wall, eval_s, rollout_frac, train_frac, eval_end, **kw):
    return {"steps": steps, "wall_s": wall, "eval_s": eval_s, "rollout_busy_frac": rollout_frac,
            "train_busy_frac": train_frac, "eval_end": eval_end, "eval_start": 0.2, "response_len_mean": 150.0, **kw}


ASYNC = dict(samples_trained=160, staleness_max=1, dropped_frac=0.0, ess_mean=0.99, multi_version_frac=0.0,
             rollout_idle_frac=0.5, train_idle_frac=0.01)


def test_runs_and_figures(monkeypatch, tmp_path):
    calls = []
    # sync on all cores: 10 steps in 30 s (10 s evaluation): rollout 0.55*30-10 = 6.5 s, train 0.4*30 = 12 s
    canned = {"sync-n2": summary(10, 30.0, 10.0, 0.55, 0.4, 0.35), "sync-n1": summary(10, 40.0, 10.0, 0.4, 0.5, 0.3),
              "sync1core-n2": summary(10, 50.0, 12.0, 0.4, 0.6, 0.35),
              "async-tauto": summary(10, 30.0, 10.0, 0.5, 0.6, 0.3, **ASYNC),
              "async-t1": summary(10, 26.0, 10.0, 0.5, 0.6, 0.36, **ASYNC)}

    def run_job(nproc, overrides, out_dir, timeout, prefix=()):
        calls.append((out_dir.name, nproc, tuple(prefix),
                      [o for o in overrides if o.startswith(("seed=", "mode=", "rollout.threads=", "--config-name"))]))
        return canned[out_dir.name.rsplit("-s", 1)[0]]

    monkeypatch.setattr(async_rl, "run_job", run_job)
    r = async_rl.main(["--steps", "10", "--seeds", "0,1", "--out", str(tmp_path), "--setting", "long",
                       "--engine-threads", "auto,1", "--", "data.n_eval=8"])
    long = "--config-name=long"
    assert calls == [("sync-n2-s0", 2, (), [long, "seed=0"]), ("sync-n1-s0", 1, (), [long, "seed=0"]),
                     ("sync1core-n2-s0", 2, ("taskset", "-c", "0"), [long, "seed=0"]),
                     ("async-tauto-s0", 2, (), [long, "mode=async", "seed=0"]),
                     ("async-t1-s0", 2, (), [long, "mode=async", "rollout.threads=1", "seed=0"]),
                     ("sync-n2-s1", 2, (), [long, "seed=1"]),
                     ("async-t1-s1", 2, (), [long, "mode=async", "rollout.threads=1", "seed=1"])]
    assert r["engine_threads"] == "1" and r["async_tried_engine_threads"] == pytest.approx({"auto": 30.0, "1": 37.5})
    assert r["sync_steps_per_min"] == pytest.approx(10 * 60 / 20) and r["async_steps_per_min"] == pytest.approx(37.5)
    assert r["speedup"] == pytest.approx(1.25) and r["sync_nproc"] == 2
    ph = r["phases_s_per_step"]
    assert (ph["rollout_c"], ph["train_c"]) == pytest.approx((0.65, 1.2))
    assert (ph["rollout_1"], ph["train_1"]) == pytest.approx(((0.4 * 50 - 12) / 10, 3.0))
    assert r["overlap_bound"] == pytest.approx((0.65 + 1.2) / ((0.8 + 3.0) / ph["cores"]))
    assert r["prediction_error"] == pytest.approx(abs(r["predicted_speedup"] - 1.25) / 1.25)
    assert r["eval_by_seed"]["1"] == {"sync": 0.35, "async": 0.36, "start": 0.2}
    assert r["rollout_idle_sync"] == pytest.approx(1 - 6.5 / 20) and r["train_idle_sync"] == pytest.approx(1 - 12 / 20)
    assert r["tokens_speedup"] == pytest.approx(1.25) and r["speedup_by_seed"]["1"] == pytest.approx(
        {"steps": 1.25, "tokens": 1.25})
    # --from: the same figures from the summaries the run kept, nothing run
    for name, summ in canned.items():
        for seed in (0, 1):
            (tmp_path / f"{name}-s{seed}").mkdir(exist_ok=True)
            (tmp_path / f"{name}-s{seed}" / "summary.json").write_text(json.dumps(summ))
    calls.clear()
    again = async_rl.main(["--steps", "10", "--seeds", "0,1", "--from", str(tmp_path), "--setting", "long",
                           "--engine-threads", "auto,1", "--", "data.n_eval=8"])
    assert calls == [] and {k: v for k, v in again.items() if k != "bench_wall_s"} == {
        k: v for k, v in r.items() if k != "bench_wall_s"}
    with pytest.raises(ValueError, match="--from: .*sync-n2-s0/summary.json is missing"):
        async_rl.main(["--from", str(tmp_path / "elsewhere")])


def test_tokens_speedup_counts_the_trained_answers_lengths(monkeypatch):
    """Async trained on answers 1.5x longer at the same steps/min: tokens_speedup 1.5, speedup 1 (control)."""
    canned = {"sync-n2": summary(10, 30.0, 10.0, 0.55, 0.4, 0.3), "sync1core-n2": summary(10, 50.0, 12.0, 0.4, 0.6, 0.3),
              "async-tauto": summary(10, 30.0, 10.0, 0.5, 0.6, 0.3, **{**ASYNC, "response_len_mean": 225.0})}
    monkeypatch.setattr(async_rl, "run_job", lambda n, o, out_dir, t, prefix=(): canned[out_dir.name.rsplit("-s", 1)[0]])
    r = async_rl.main(["--steps", "10", "--seeds", "0", "--sync-nproc", "2"])
    assert r["speedup"] == pytest.approx(1.0) and r["tokens_speedup"] == pytest.approx(1.5)


def test_bad_engine_threads_refused():
    with pytest.raises(ValueError, match="--engine-threads='auto,0'"):
        async_rl.main(["--engine-threads", "auto,0"])


def test_prediction_takes_the_runs_lengths_and_fitted_decode_step():
    """run_lengths reads the sync run's answer lengths and the one-core run's step fit and engine seconds; the
    lengths-aware prediction is what plan/shared_host gives for them, and differs from the one-length one."""
    from moe_lora_rl.plan.lengths import parse_lengths
    from moe_lora_rl.plan.shared_host import HostPhases, predict

    sync = summary(10, 30.0, 10.0, 0.55, 0.4, 0.0, response_len_mean=150.0, len_p90=250, engine_occupancy=12.5)
    one = summary(10, 50.0, 12.0, 0.4, 0.6, 0.0, engine_step_fit={"fixed_s": 0.01, "per_seq_s": 0.0005},
                  engine_decode_s=6.0)
    ln = plan_model.run_lengths(sync, one, 32, 400)
    assert (ln.dist, ln.batch, ln.engine_frac) == (parse_lengths("150", 400), 32, 6.0 / 8.0)
    assert ln.fixed_frac == pytest.approx(0.01 / 0.026) and ln.longest() == pytest.approx(32 * 150 / 12.5)
    assert plan_model.run_lengths(sync, {**one, "engine_step_fit": None}, 32, 400) is None
    lognormal = parse_lengths("mean=150,p90=250", 400)
    assert plan_model.spec_occupancy(sync, 32, 400)["occupancy_sync"] == pytest.approx(
        32 * lognormal.mean / lognormal.expected_max(32))
    assert plan_model.spec_occupancy({**sync, "len_p90": 120}, 32, 400) is None          # no tail
    ph = HostPhases(rollout_1=0.8, rollout_c=0.65, train_1=3.0, train_c=1.2, cores=2)
    assert predict(ph, 4, ln)["predicted_speedup"] > predict(ph, 4)["predicted_speedup"]
