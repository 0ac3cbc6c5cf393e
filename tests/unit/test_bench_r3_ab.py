"""bench r3_ab's pure parts: when a run counts as collapsed, and which KL each replay mode's curve follows."""
from moe_lora_rl.bench.r3_ab import SETTINGS, collapsed, curve


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
