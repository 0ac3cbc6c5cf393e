"""Shared-host (CPU) sync vs async prediction: the formulas against hand-computed numbers, the refusals, the CLI."""
import json

import pytest

from moe_lora_rl.plan.cli import main
from moe_lora_rl.plan.shared_host import HostPhases, async_bounds_s, predict

KEYS = {"sync_step_s", "async_step_s", "sync_steps_per_min", "async_steps_per_min", "predicted_speedup",
        "overlap_bound", "limit", "implied_staleness"}


def test_measured_two_core_figures_give_the_issue_bound():
    # the issue's 20-step figures: rollout 10.1 s on 1 core, 11.4 s on 2; training 28.5 s on 1, 14.2 s on 2
    d = predict(HostPhases(rollout_1=10.1, rollout_c=11.4, train_1=28.5, train_c=14.2, cores=2), max_staleness=1)
    assert set(d) == KEYS
    assert d["sync_step_s"] == pytest.approx(25.6)                  # 11.4 + 14.2
    assert d["async_step_s"] == pytest.approx(19.3)                 # max(38.6 / 2, 10.1, 14.2)
    assert d["limit"] == "cores"
    assert d["overlap_bound"] == pytest.approx(25.6 / 19.3)         # (11.4 + 14.2) / ((10.1 + 28.5) / 2)
    assert round(d["overlap_bound"], 2) == 1.33
    assert d["predicted_speedup"] == pytest.approx(25.6 / 19.3)     # cores-bound, no refit: equals the bound
    assert d["sync_steps_per_min"] == pytest.approx(60 / 25.6)
    assert d["async_steps_per_min"] == pytest.approx(60 / 19.3)


def test_rollout_bound():
    # bounds: cores (10 + 4 + 1) / 2 = 7.5, rollout 10, train 2 + 1 = 3; sync 10 + 2 + 1 = 13
    d = predict(HostPhases(rollout_1=10, rollout_c=10, train_1=4, train_c=2, cores=2, refit=1), max_staleness=2)
    assert d["limit"] == "rollout" and d["async_step_s"] == pytest.approx(10)
    assert d["sync_step_s"] == pytest.approx(13) and d["predicted_speedup"] == pytest.approx(1.3)
    assert d["overlap_bound"] == pytest.approx(13 / 7)              # refit not in the denominator


def test_train_bound():
    # bounds: cores (2 + 20 + 0.5) / 4 = 5.625, rollout 2, train 8 + 0.5 = 8.5; sync 2.5 + 8 + 0.5 = 11
    p = HostPhases(rollout_1=2, rollout_c=2.5, train_1=20, train_c=8, cores=4, refit=0.5)
    assert async_bounds_s(p) == pytest.approx({"cores": 5.625, "rollout": 2, "train": 8.5, "staleness": 2})
    d = predict(p, max_staleness=1)
    assert d["limit"] == "train" and d["async_step_s"] == pytest.approx(8.5)
    assert d["predicted_speedup"] == pytest.approx(11 / 8.5)


@pytest.mark.parametrize("refit", [0.0, 0.7])
def test_one_core_nothing_overlaps(refit):
    d = predict(HostPhases(rollout_1=3, rollout_c=3, train_1=5, train_c=5, cores=1, refit=refit), max_staleness=4)
    assert d["async_step_s"] == pytest.approx(8 + refit) and d["predicted_speedup"] <= 1
    assert d["predicted_speedup"] == pytest.approx(1)


def test_staleness_adds_nothing_beyond_one():
    p = HostPhases(rollout_1=10.1, rollout_c=11.4, train_1=28.5, train_c=14.2, cores=2)
    assert predict(p, 1) == predict(p, 8)


@pytest.mark.parametrize("kw, text", [
    ({"rollout_1": 0}, "rollout_1=0"),
    ({"train_c": -1.0}, "train_c=-1.0"),
    ({"rollout_c": float("nan")}, "rollout_c=nan"),
    ({"refit": -0.1}, "refit=-0.1"),
    ({"cores": 0}, "cores=0"),
    ({"cores": 2.0}, "cores=2.0"),
    ({"cores": 1}, "cores=1: the all-core figures are the one-core figures"),
])
def test_phases_refused(kw, text):
    args = {"rollout_1": 1.0, "rollout_c": 1.1, "train_1": 2.0, "train_c": 1.0, "cores": 2, **kw}
    with pytest.raises(ValueError, match=text.replace("(", "\\(")):
        HostPhases(**args)


@pytest.mark.parametrize("k", [0, -1, True, 1.0])
def test_staleness_refused(k):
    with pytest.raises(ValueError, match=f"max_staleness={k!r}"):
        predict(HostPhases(rollout_1=1, rollout_c=1, train_1=2, train_c=1, cores=2), k)


def test_cli_json(capsys):
    assert main(["--host-cores", "2", "--rollout-s", "10.1,11.4", "--train-s", "28.5,14.2", "--refit-s", "0",
                 "--staleness", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    d = json.loads(out)
    assert set(d) == KEYS | {"shared_host", "max_staleness"}
    assert d["shared_host"] == {"rollout_1": 10.1, "rollout_c": 11.4, "train_1": 28.5, "train_c": 14.2, "cores": 2,
                                "refit": 0.0}
    assert d["max_staleness"] == 2 and d["limit"] == "cores"
    assert d["sync_step_s"] == pytest.approx(25.6) and d["async_step_s"] == pytest.approx(19.3)
    assert round(d["overlap_bound"], 2) == 1.33 and round(d["predicted_speedup"], 2) == 1.33


def test_cli_table(capsys):
    assert main(["--host-cores", "2", "--rollout-s", "10.1,11.4", "--train-s", "28.5,14.2"]) == 0
    out = capsys.readouterr().out
    assert "sync 25.6, async 19.3 (bound by cores)" in out and "overlap bound 1.33" in out


@pytest.mark.parametrize("args, text", [
    (["--rollout-s", "1,2"], "needs --host-cores, --rollout-s and --train-s; missing --host-cores, --train-s"),
    (["--host-cores", "2", "--train-s", "1,2", "--refit-s", "1"], "missing --rollout-s"),
    (["--host-cores", "two", "--rollout-s", "1,2", "--train-s", "1,2"], "--host-cores='two'"),
    (["--host-cores", "2", "--rollout-s", "1", "--train-s", "1,2"], "--rollout-s='1': expected ONE_CORE,ALL_CORES"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,-2"], "--train-s: train_c=-2.0"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--refit-s", "x"], "--refit-s='x'"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--staleness", "0"],
     "--staleness: max_staleness=0"),
])
def test_cli_refusal_one_line(args, text, capsys):
    assert main(args) == 2
    o = capsys.readouterr()
    assert o.out == "" and o.err.startswith("moe-lora-rl plan: error: ") and o.err.count("\n") == 1
    assert text in o.err and "Traceback" not in o.err


def test_policies_together_vs_apart():
    """Two policies: apart, two setups and 2 x steps synchronous steps; together, one setup and turns set by the
    async bounds (here the cores: (10.1 + 28.5) / 2 = 19.3 s against sync 11.4 + 14.2 = 25.6 s). One policy is a run
    of one: no speedup. Negative control: on one core nothing overlaps, only the setup is saved."""
    from moe_lora_rl.plan.shared_host import HostPhases, predict_policies

    p = HostPhases(rollout_1=10.1, rollout_c=11.4, train_1=28.5, train_c=14.2, cores=2)
    two = predict_policies(p, 2, 20, setup_s=60.0, eval_s=5.0)
    assert two["turn_s"] == pytest.approx(19.3) and two["limit"] == "cores" and two["sync_step_s"] == pytest.approx(25.6)
    assert two["apart_s"] == pytest.approx(2 * 65 + 40 * 25.6) and two["together_s"] == pytest.approx(70 + 40 * 19.3)
    assert two["predicted_speedup_loop"] == pytest.approx(25.6 / 19.3)
    assert predict_policies(p, 1, 20, setup_s=60.0)["predicted_speedup"] == pytest.approx(1.0)
    one_core = HostPhases(rollout_1=10.1, rollout_c=10.1, train_1=28.5, train_c=28.5, cores=1)
    c = predict_policies(one_core, 2, 20, setup_s=60.0)
    assert c["predicted_speedup_loop"] == pytest.approx(1.0) and c["apart_s"] - c["together_s"] == pytest.approx(60)
    for kw, msg in (({"policies": 0}, "policies=0"), ({"steps": 0}, "steps=0"), ({"setup_s": -1.0}, "setup_s=-1.0")):
        with pytest.raises(ValueError, match=msg):
            predict_policies(p, **{"policies": 2, "steps": 20, **kw})


def test_cli_policies_row_and_refusals(capsys):
    from moe_lora_rl.plan.cli import run

    assert main(["--host-cores", "2", "--rollout-s", "10.1,11.4", "--train-s", "28.5,14.2", "--policies", "2",
                 "--steps", "20", "--setup-s", "60", "--eval-s", "5", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["policies"]["predicted_speedup_loop"] == pytest.approx(25.6 / 19.3)
    assert line["policies"]["together_s"] == pytest.approx(70 + 40 * 19.3)
    for argv, msg in ((["--policies", "2"], "--policies=2: predicted on the shared host"),
                      (["--host-cores", "2", "--rollout-s", "10,11", "--train-s", "28,14", "--policies", "0"],
                       "--policies: policies=0")):
        with pytest.raises(ValueError, match=msg):
            run(argv)
