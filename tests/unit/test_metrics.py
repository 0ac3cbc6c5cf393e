"""Run metrics: JSONL round trip, TensorBoard event file read back with tensorboard's EventAccumulator, the progress
bar's live fields, a resumed run's logs reading as one run, and the plot."""
import io
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("tensorboard", reason="tensorboard is in the main venv only (the driver's venv)")
pytest.importorskip("matplotlib", reason="matplotlib is in the main venv only (the driver's venv)")

from moe_lora_rl.rl import metrics as M  # noqa: E402


def records(n=12, start=1, shift=0.0):
    out = []
    for s in range(start, start + n):
        r = {M.REWARD: 0.1 + 0.05 * s + shift, M.KL_R3: 1e-4 * (1 + s % 3), M.KL_NO_R3: 3e-3 / (1 + 0.1 * s),
             M.DISAGREEMENT: 0.02 + 0.001 * s, "loss": torch.tensor(0.5 - 0.01 * s), "clipped": s % 2 == 0,
             "router": {"per_layer": {1: np.float32(0.25), 2: 0.125}}, "event": "ok"}
        if s % 5 == 0:
            r[M.EVAL_SUCCESS] = 0.2 + 0.03 * s
        out.append((s, r))
    return out


def scalars(tb_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture
def run(tmp_path):
    bar = io.StringIO()
    with M.MetricsLogger(tmp_path, total_steps=12, bar_file=bar) as log:
        for s, r in records():
            log.log(s, r)
    return tmp_path, bar.getvalue()


def test_jsonl_round_trip(run):
    out, _ = run
    got = M.read_jsonl(out / M.JSONL)
    want = records()
    assert [r["step"] for r in got] == [s for s, _ in want]
    for g, (s, r) in zip(got, want):
        flat = M.flatten(r)
        assert set(g) == {"step", "time"} | set(flat)
        for k, v in flat.items():
            assert g[k] == v, (s, k)                       # exact: json round-trips doubles
    assert got[2]["router/per_layer/1"] == 0.25 and got[2]["loss"] == pytest.approx(0.47, abs=1e-7)


def test_tensorboard_event_file_has_the_values(run):
    out, _ = run
    tb = scalars(out / M.TB_DIR)
    want = records()
    for k in (M.REWARD, M.KL_R3, M.KL_NO_R3, M.DISAGREEMENT, "loss", "clipped", "router/per_layer/2"):
        assert sorted(tb[k]) == list(range(1, 13)), k
        for s, r in want:
            assert tb[k][s] == pytest.approx(float(M.flatten(r)[k]), rel=1e-6), (k, s)   # stored as fp32
    assert sorted(tb[M.EVAL_SUCCESS]) == [5, 10]
    assert "event" not in tb                                   # text is JSONL only


def test_bar_shows_reward_kl_disagreement(run):
    _, bar = run
    last = bar.strip().split("\r")[-1]
    assert "12/12" in last, last
    assert "reward=0.7" in last and "kl=0.0001" in last and "dis=0.032" in last, last


def test_resume_drops_later_records(run):
    """An interrupted run logged steps 1..12; resuming from the checkpoint of step 6 replaces steps 7.. in both the
    JSONL and TensorBoard; a fresh run in the same directory starts both afresh."""
    out, _ = run
    with M.MetricsLogger(out, total_steps=12, resumed_at=6, bar=False) as log:
        for s, r in records(n=6, start=7, shift=1.0):
            log.log(s, r)
    got = M.read_jsonl(out / M.JSONL)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert got[5][M.REWARD] == pytest.approx(0.4) and got[6][M.REWARD] == pytest.approx(1.45)
    tb = scalars(out / M.TB_DIR)[M.REWARD]
    assert sorted(tb) == list(range(1, 13))
    assert tb[6] == pytest.approx(0.4) and tb[7] == pytest.approx(1.45) and tb[12] == pytest.approx(1.7)
    with M.MetricsLogger(out, total_steps=12, bar=False) as log:
        log.log(1, {M.REWARD: 9.0})
    assert [(r["step"], r[M.REWARD]) for r in M.read_jsonl(out / M.JSONL)] == [(1, 9.0)]
    assert scalars(out / M.TB_DIR)[M.REWARD] == {1: 9.0}


def test_disabled_writes_nothing(tmp_path):
    log = M.MetricsLogger(tmp_path / "r1", total_steps=3, enabled=False)
    log.log(0, {M.REWARD: 1.0})
    log.close()
    assert not (tmp_path / "r1").exists()


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="total_steps=0"):
        M.MetricsLogger(tmp_path, total_steps=0)
    with M.MetricsLogger(tmp_path, total_steps=3, bar=False) as log:
        log.log(2, {"step": 2, M.REWARD: 1.0})                   # the driver's records carry their step
        with pytest.raises(ValueError, match="step=3, logged as step 1"):
            log.log(1, {"step": 3})
    assert M.read_jsonl(tmp_path / M.JSONL)[0]["step"] == 2
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics records"):
        M.plot(tmp_path / "empty.jsonl", tmp_path / "x.png")


def test_plot_png(run, tmp_path):
    from matplotlib.image import imread

    out, _ = run
    png = M.plot(out / M.JSONL, tmp_path / "plot.png")
    img = imread(png)
    assert img.shape[:2] == (1050, 1000) and png.stat().st_size > 20_000
    rgb = img[..., :3].reshape(-1, 3)
    colors = {tuple(c) for c in np.round(rgb, 2)}
    assert len(colors) > 50, len(colors)                          # lines, text and axes, not a blank canvas
    blue, orange = np.array([0.12, 0.47, 0.71]), np.array([1.0, 0.5, 0.05])   # the first two line colours
    for c in (blue, orange):
        assert (np.abs(rgb - c).max(1) < 0.05).sum() > 200, c


def test_plot_negative_control(tmp_path):
    """A run that logged none of the plotted keys gives panels without lines: the colour check above can fail."""
    from matplotlib.image import imread

    with M.MetricsLogger(tmp_path, total_steps=2, bar=False) as log:
        log.log(0, {"loss": 1.0})
    img = imread(M.plot(tmp_path / M.JSONL, tmp_path / "p.png"))[..., :3].reshape(-1, 3)
    assert (np.abs(img - np.array([0.12, 0.47, 0.71])).max(1) < 0.05).sum() == 0


def test_plot_cli(run, tmp_path, capsys):
    out, _ = run
    assert M.main([str(out / M.JSONL), str(tmp_path / "c.png")]) == 0 and (tmp_path / "c.png").is_file()
    assert M.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "d.png")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert not math.isnan(json.loads((out / M.JSONL).read_text().splitlines()[0])["time"])
