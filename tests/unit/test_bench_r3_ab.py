"""bench r3_ab's pure parts: when a run counts as collapsed, which KL each replay mode's curve follows, the figure
on synthetic metrics, the named settings' overrides, and runs kept in --out across calls (--reuse) with jobs
replaced by a stand-in that writes a summary."""
import json

import pytest

from moe_lora_rl.bench.r3_ab import main
from moe_lora_rl.bench.runners.figures import R3_AB_CURVES as CURVES, r3_ab_png as plot
from moe_lora_rl.bench.runners.r3_ab_runs import SETTINGS, collapsed, curve, last2


def test_collapsed_on_the_mean_of_the_last_two_evaluations():
    assert not collapsed({0: 0.398, 10: 0.398, 20: 0.422, 30: 0.453, 40: 0.453})   # the long run at lr 3e-4: holds
    assert collapsed({0: 0.398, 10: 0.35, 20: 0.30, 30: 0.25, 40: 0.234})          # at lr 1e-3: 0.156 below start
    assert not collapsed({0: 0.40, 10: 0.42, 20: 0.44, 30: 0.36})    # one low final evaluation: last two 0.40
    assert collapsed({"0": 0.30, "10": 0.55, "20": 0.45, "30": 0.44})  # 0.105 below its best (JSON keys: strings)
    assert not collapsed({"0": 0.30, "10": 0.53, "20": 0.45, "30": 0.44})   # 0.085 below its best
    assert collapsed({0: 0.4, 10: 0.3, 20: 0.3})                     # exactly 0.1 below its start counts
    assert not collapsed({0: 0.4, 10: 0.31, 20: 0.31})
    assert not collapsed({0: 0.4}) and not collapsed({0: 0.4, 10: 0.32})
    assert last2({"0": 0.4, "100": 0.2, "90": 0.3}) == pytest.approx(0.25)      # steps in order, not as strings
    with pytest.raises(ValueError, match="without held-out evaluations"):
        last2({})


def test_curve_follows_the_trained_policys_kl():
    rows = [{"step": 1, "r3_kl": 1e-4, "no_r3_kl": 5e-3, "grad_norm": 0.2, "pg_clipfrac": 0.0},
            {"step": 2, "r3_kl": 2e-4, "no_r3_kl": 6e-3, "grad_norm": 0.3, "pg_clipfrac": 0.1, "eval": 0.4}]
    assert [r["kl"] for r in curve(rows, "r3")] == [1e-4, 2e-4]
    assert [r["kl"] for r in curve(rows, "off")] == [5e-3, 6e-3]
    assert curve(rows, "r3")[1] == {"step": 2, "eval": 0.4, "kl": 2e-4, "grad_norm": 0.3, "pg_clipfrac": 0.1}
    assert SETTINGS["default"] == [] and all(s for k, s in SETTINGS.items() if k != "default")


def metrics_rows(steps: int, shift: float) -> list[dict]:
    """A run's metrics.jsonl as the job writes it: both replay modes' figures every step, held-out every 10."""
    rows = []
    for t in range(1, steps + 1):
        r = {"step": t, "grad_norm": 0.2 + shift, "pg_clipfrac": 0.01 * shift, "response_len": 100 + t}
        for pre, k in (("r3_", 1e-4), ("no_r3_", 1e-3)):
            r.update({pre + "kl": k * t, pre + "ratio_gt2": k, pre + "ratio_gt5": k / 4, pre + "seq_ratio_gt2": 10 * k,
                      pre + "seq_log_ratio_max": 100 * k, pre + "kl_first_half": k, pre + "kl_second_half": 2 * k})
        if t % 10 == 0:
            r["eval"] = 0.4 - shift * t / 100
        rows.append(r)
    return rows


def test_every_panel_has_its_curves_on_synthetic_metrics(tmp_path, monkeypatch):
    """Every panel's keys come out of curve() for both replay modes; the PNG is drawn with one line per run and
    key in each panel (counted on the axes before saving)."""
    curves = {(replay, seed): curve(metrics_rows(30, 0.1 * (replay == "off") + 0.01 * seed), replay)
              for replay in ("r3", "off") for seed in (0, 1)}
    keys = {k for _, ks in CURVES for k in ks}
    for rows in curves.values():
        assert keys <= set().union(*rows), keys - set().union(*rows)
    drawn = {}
    import moe_lora_rl.bench.runners.figures as figures

    save = figures.save
    monkeypatch.setattr(figures, "save", lambda fig, title, png: (drawn.update(
        {ax.get_title(): len(ax.get_lines()) for ax in fig.axes}), save(fig, title, png))[1])
    png = plot(curves, tmp_path / "r3_ab.png", "synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {name: drawn[name] for name, _ in CURVES} == {name: 4 * len(ks) for name, ks in CURVES}


def fake_summary(evals: dict) -> dict:
    keys = ("eval_start", "eval_end", "kl_mean_r3", "kl_mean_no_r3", "ratio_gt2", "ratio_gt2_no_r3", "ratio_gt5",
            "ratio_gt5_no_r3", "response_len_mean", "grad_norm_mean", "clipfrac_mean")
    by_len = [f"{n}_{t}" for n in ("seq_ratio_gt2", "seq_log_ratio_max", "kl_first_half", "kl_second_half")
              for t in ("r3", "no_r3")]
    return {**{k: 0.1 for k in (*keys, *by_len)}, "evals": evals, "steps": 60}


@pytest.fixture
def jobs(monkeypatch):
    """run_job replaced: records (folder, overrides), writes the run's metrics and summary; a folder named in
    jobs.fail stops before its summary (an unfinished run, its checkpoints kept)."""
    class Jobs(list):
        fail: set = set()

    started = Jobs()

    def job(nproc, overrides, out, timeout):
        started.append((out.name, overrides))
        (out / "checkpoints").mkdir(exist_ok=True)
        if out.name in started.fail:
            raise RuntimeError("killed")
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_rows(20, 0.0)))
        s = fake_summary({"0": 0.4, "10": 0.4, "20": 0.2 if out.name == "off-s1" else 0.41})
        (out / "summary.json").write_text(json.dumps(s))
        return s

    monkeypatch.setattr("moe_lora_rl.bench.r3_ab.run_job", job)
    return started


def test_long_setting_overrides(jobs):
    """long_w500_lr3e-4: the long recipe, its 500-step warm start, lr 3e-4, no rollout correction, 60 steps,
    held-out every 10 steps on 128 x 4 samples; --steps and a model.warm_* override replace the setting's steps and
    warm start."""
    out = main(["--setting", "long_w500_lr3e-4", "--seeds", "0,1"])
    assert [name for name, _ in jobs] == ["r3-s0", "off-s0", "r3-s1", "off-s1"]
    over = jobs[0][1]
    for o in ("--config-name=long", "model.warm_steps=500", "algo.lr=3e-4", "algo.rollout_is=off", "steps=60",
              "eval_every=10", "data.eval_samples=4", "replay=r3", "seed=0"):
        assert o in over, (o, over)
    assert jobs[1][1] == [*over[:-2], "replay=off", "seed=0"]         # R3 vs off: the same overrides otherwise
    assert not any(o.startswith(("resume", "checkpoint_every")) for o in over)      # no --out: nothing to resume
    assert out["setting"] == "long_w500_lr3e-4" and out["collapsed_off"] == 1 and out["collapsed_r3"] == 0
    assert out["eval_last2_r3"] == pytest.approx(0.405) and out["eval_last2_off"] == pytest.approx((0.405 + 0.3) / 2)
    jobs.clear()
    main(["--setting", "long_w500_mini4_lr1e-3", "--seeds", "0", "--steps", "80", "--", "model.warm_steps=400"])
    over = jobs[0][1]
    assert "steps=80" in over and "steps=60" not in over and "algo.mini_batches=4" in over
    assert "model.warm_steps=400" in over and "model.warm_steps=500" not in over     # the user's warm start


def test_runs_kept_in_out_are_read_back_and_continued(jobs, tmp_path):
    """--out keeps each run (its overrides, checkpoint_every, resume=auto); --reuse reads the finished ones, runs an
    unfinished one again in its folder (resume=auto continues it), and refuses, before any run, a folder made
    under other overrides; without --reuse, a folder holding checkpoints is refused (it would be resumed)."""
    out_dir = str(tmp_path / "ab")
    jobs.fail = {"off-s1"}
    with pytest.raises(RuntimeError, match="killed"):
        main(["--seeds", "0,1", "--out", out_dir])
    assert [n for n, _ in jobs] == ["r3-s0", "off-s0", "r3-s1", "off-s1"]
    assert {"checkpoint_every=10", "resume=auto"} <= set(jobs[0][1])
    recorded = json.loads((tmp_path / "ab" / "off-s1" / "bench_overrides.json").read_text())
    assert recorded == jobs[3][1]
    jobs.clear()
    with pytest.raises(ValueError, match=r"r3-s0 holds an earlier run's checkpoints: --reuse continues it"):
        main(["--seeds", "0,1", "--out", out_dir])
    with pytest.raises(ValueError, match=r"r3-s0 was run with other overrides \(algo.lr=1e-3 differ\)"):
        main(["--seeds", "0,1", "--out", out_dir, "--reuse", "--", "algo.lr=1e-3"])
    with pytest.raises(ValueError, match=r"r3-s0 was run with other overrides \(steps=5 differ\)"):
        main(["--seeds", "0,1", "--out", out_dir, "--reuse", "--steps", "5"])
    assert jobs == []
    jobs.fail = set()
    out = main(["--seeds", "0,1", "--out", out_dir, "--reuse"])
    assert [n for n, _ in jobs] == ["off-s1"] and jobs[0][1] == recorded
    assert out["reused"] == ["off-s0", "r3-s0", "r3-s1"] and out["resumed"] == ["off-s1"]
    assert (tmp_path / "ab" / "r3_ab.png").is_file() and out["evals"]["off-s1"]["20"] == 0.2
    jobs.clear()
    out = main(["--seeds", "0,1", "--out", out_dir, "--reuse"])
    assert jobs == [] and out["resumed"] == [] and len(out["reused"]) == 4


@pytest.mark.parametrize("argv,needle", [
    (["--", "replay=r2"], "override 'replay=r2': r3_ab sets replay"),
    (["--", "layout.tp=2"], "override 'layout.tp=2': r3_ab sets"),
    (["--seeds", "0,0"], "--seeds='0,0': expected distinct seeds >= 0"),
    (["--seeds", "0,-1"], "--seeds='0,-1': expected distinct seeds >= 0"),
    (["--layouts", "tp2ep2,pp2"], "r3_ab runs one layout"),
    (["--", "algo.lr=-1"], "algo.lr=-1"),
    (["--", "resume=true"], "override 'resume=true': r3_ab sets"),
    (["--", "checkpoint_every=5"], "override 'checkpoint_every=5': r3_ab sets"),
    (["--reuse"], "--reuse reads and continues the runs of --out"),
    (["--setting", "long_w500"], "--setting='long_w500' is not one of"),
])
def test_refused_before_any_run(argv, needle, monkeypatch):
    """Every argument is honoured or refused before a job starts (tests/unit/test_bench_cli.py runs one through
    the bench's command line: one line, exit 2)."""
    monkeypatch.setattr("moe_lora_rl.bench.r3_ab.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        main(argv)
