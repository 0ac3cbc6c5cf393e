"""bench r3_ab's pure parts: when a run counts as collapsed, and which KL each replay mode's curve follows."""
import pytest

from moe_lora_rl.bench.r3_ab import SETTINGS, collapsed, curve, main


def test_collapsed():
    assert not collapsed({0: 0.15, 10: 0.25, 20: 0.3})
    assert collapsed({0: 0.15, 10: 0.25, 20: 0.1})                 # ends below its start
    assert collapsed({"0": 0.15, "10": 0.5, "20": 0.3})            # fell 0.2 from its best (JSON keys are strings)
    assert not collapsed({"0": 0.15, "10": 0.35, "20": 0.3})


def test_curve_follows_the_trained_policys_kl():
    rows = [{"step": 1, "r3_kl": 1e-4, "no_r3_kl": 5e-3, "grad_norm": 0.2, "pg_clipfrac": 0.0},
            {"step": 2, "r3_kl": 2e-4, "no_r3_kl": 6e-3, "grad_norm": 0.3, "pg_clipfrac": 0.1, "eval": 0.4}]
    assert [r["kl"] for r in curve(rows, "r3")] == [1e-4, 2e-4]
    assert [r["kl"] for r in curve(rows, "off")] == [5e-3, 6e-3]
    assert curve(rows, "r3")[1] == {"step": 2, "eval": 0.4, "kl": 2e-4, "grad_norm": 0.3, "pg_clipfrac": 0.1}
    assert SETTINGS["default"] == [] and all(s for k, s in SETTINGS.items() if k != "default")


@pytest.mark.parametrize("argv,needle", [
    (["--", "replay=r2"], "override 'replay=r2': r3_ab sets replay"),
    (["--", "layout.tp=2"], "override 'layout.tp=2': r3_ab sets"),
    (["--seeds", "0,0"], "--seeds='0,0': expected distinct seeds >= 0"),
    (["--seeds", "0,-1"], "--seeds='0,-1': expected distinct seeds >= 0"),
    (["--layouts", "tp2ep2,pp2"], "r3_ab runs one layout"),
    (["--", "algo.lr=-1"], "algo.lr=-1"),
])
def test_refused_before_any_run(argv, needle, monkeypatch):
    """Every argument is honoured or refused before a job starts (tests/unit/test_bench_cli.py runs one through
    the bench's command line: one line, exit 2)."""
    monkeypatch.setattr("moe_lora_rl.bench.r3_ab.run_job", lambda *a, **k: pytest.fail("a job started"))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        main(argv)
