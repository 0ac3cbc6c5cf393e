"""Training checkpoints in one process: round trip of adapters + AdamW state + run state, exact next step, the
refusals (no checkpoint, truncated file, wrong checksum, another model, another LoRA config) with nothing changed,
a failed rename mid-save leaving the previous checkpoint loadable, and the reshard read plan (pure). Kills at every
crash point, corruption fallbacks and full disks: test_checkpoint_crash.py.

The model is a stand-in holding adapter factors with their sharding metadata (what the checkpoint reads); the
Megatron model at several layouts is tests/distributed/test_checkpoint_resume.py."""
import json
import shutil

import pytest
import torch

from moe_lora_rl.lora.config import LoRAConfig
from moe_lora_rl.lora.layers import FactorMeta
from moe_lora_rl.checkpoint import api as ck
from kit.checkpoint_crash import make, step
from moe_lora_rl.checkpoint.reshard_plan import Piece, plan_reads


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 6}))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)   # identity by content: its bytes are hashed
    return d


@pytest.fixture
def saved(tmp_path, model_dir):
    m, opt = make()
    for _ in range(3):
        step(m, opt)
    meta = ck.describe_run(model_dir, m.lora_config, "tp1ep1pp1")
    state = {"step": 3, "version": 3, "data_pos": 24, "rng": ck.rng_state()}
    path = ck.save_checkpoint(tmp_path / "ckpt", 3, m, opt, run_meta=meta, state=state)
    return m, opt, meta, path


def snapshot(m, opt):
    return ({k: v.detach().clone() for k, v in m.named_parameters()},
            {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for p, s in opt.state.items()})


def same(a, b):
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(pa[k], pb[k]) for k in pa) and sa.keys() == sb.keys() and \
        all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_round_trip_and_exact_next_step(saved):
    m, opt, meta, path = saved
    assert path.name == "step-00000003" and ck.latest_step(path.parent) == 3
    fresh, fopt = make(lr=0.5)                         # hyperparameters come back from the checkpoint
    state = ck.load_checkpoint(path.parent, fresh, fopt, run_meta=meta)
    assert state["step"] == 3 and state["data_pos"] == 24
    assert fopt.param_groups[0]["lr"] == 0.05 and fopt.param_groups[0]["betas"] == (0.9, 0.999)
    for p, q in ((m.A, fresh.A), (m.B, fresh.B)):
        assert torch.equal(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fopt.state[q][k]), k
    step(m, opt)
    step(fresh, fopt)
    assert torch.equal(m.A, fresh.A) and torch.equal(m.B, fresh.B)


def test_adapters_only_diverges(saved):
    """Negative control: the same weights with a fresh optimizer give a different next step."""
    m, opt, meta, path = saved
    fresh, fopt = make()
    ck.load_checkpoint(path.parent, fresh, None, run_meta=meta)
    assert torch.equal(m.B, fresh.B) and not fopt.state
    step(m, opt)
    step(fresh, fopt)
    assert (m.B - fresh.B).abs().max() > 1e-3


def test_param_without_optimizer_state(tmp_path, model_dir):
    """A factor the optimizer never stepped (no gradient yet) has no state after loading either."""
    m, opt = make()
    opt.zero_grad()
    (m.A.sum() * 0 + m.B.sum()).backward()
    m.A.grad = None
    opt.step()
    assert m.A not in opt.state and m.B in opt.state
    meta = ck.describe_run(model_dir, m.lora_config)
    ck.save_checkpoint(tmp_path / "c", 1, m, opt, run_meta=meta, state={})
    fresh, fopt = make()
    ck.load_checkpoint(tmp_path / "c", fresh, fopt, run_meta=meta)
    assert fresh.A not in fopt.state and torch.equal(fopt.state[fresh.B]["exp_avg"], opt.state[m.B]["exp_avg"])


def test_rng_state_round_trip(saved):
    import random

    import numpy as np

    _, _, meta, path = saved
    want = (random.random(), np.random.rand(), torch.rand(1))
    state = ck.load_checkpoint(path.parent, *make(), run_meta=meta)
    random.random(), np.random.rand(), torch.rand(3)
    ck.set_rng_state(state["rng"])
    assert (random.random(), np.random.rand()) == want[:2] and torch.equal(torch.rand(1), want[2])


def refused(tmp_root, model, opt, meta, match, step=None):
    before = snapshot(model, opt)
    files = {f: f.read_bytes() for f in tmp_root.rglob("*") if f.is_file()} if tmp_root.exists() else {}
    with pytest.raises(ValueError, match=match) as e:
        ck.load_checkpoint(tmp_root, model, opt, run_meta=meta, step=step)
    assert "\n" not in str(e.value)
    assert same(before, snapshot(model, opt)), "a refused load changed the model or the optimizer"
    assert files == {f: f.read_bytes() for f in tmp_root.rglob("*") if f.is_file()} if files else True
    return str(e.value)


def trained():
    m, opt = make()
    step(m, opt)
    return m, opt


def test_refuses_no_checkpoint(tmp_path, model_dir):
    m, opt = trained()
    meta = ck.describe_run(model_dir, m.lora_config)
    msg = refused(tmp_path / "none", m, opt, meta, "no checkpoint to resume from")
    assert str(tmp_path / "none") in msg
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", m, opt, meta, "no checkpoint to resume from")


def test_refuses_missing_step(saved):
    _, _, meta, path = saved
    refused(path.parent, *trained(), meta, "step-00000007: no such checkpoint", step=7)


def test_refuses_truncated_file(saved):
    _, _, meta, path = saved
    f = path / "optim-00000.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    msg = refused(path.parent, *trained(), meta, "truncated")
    assert str(f) in msg


def test_refuses_wrong_checksum(saved):
    _, _, meta, path = saved
    f = path / "adapter-00000.safetensors"
    b = bytearray(f.read_bytes())
    b[-1] ^= 0x01                                     # same size, one bit of a tensor flipped
    f.write_bytes(bytes(b))
    msg = refused(path.parent, *trained(), meta, "fails its checksum")
    assert str(f) in msg


def test_refuses_state_file_corruption(saved):
    _, _, meta, path = saved
    f = path / "state-00000.pt"
    f.write_bytes(f.read_bytes() + b"x")
    assert str(f) in refused(path.parent, *trained(), meta, "truncated or altered")


def test_model_identity_is_its_content_not_its_path(saved, model_dir, tmp_path):
    """A copy of the same model elsewhere (a resume from another output folder, a moved model) loads; another
    config or other weights under the same config are refused, naming the key and both paths."""
    _, _, meta, path = saved
    copy = tmp_path / "elsewhere" / "model"
    shutil.copytree(model_dir, copy)
    m, opt = trained()
    assert ck.describe_run(copy, m.lora_config)["model"]["path"] != meta["model"]["path"]
    assert ck.load_checkpoint(path.parent, *make(), run_meta=ck.describe_run(copy, m.lora_config))["step"] == 3
    b = bytearray((copy / "model.safetensors").read_bytes())
    b[5000] ^= 0x01                                   # same size and config, one weight byte changed
    (copy / "model.safetensors").write_bytes(bytes(b))
    msg = refused(path.parent, m, opt, ck.describe_run(copy, m.lora_config), "another model: weights_digest")
    assert str(model_dir.resolve()) in msg and str(copy) in msg
    (copy / "config.json").write_text(json.dumps({"hidden_size": 7}))
    refused(path.parent, m, opt, ck.describe_run(copy, m.lora_config), "another model: config_sha256")
    no_id = {**meta, "model": {"path": meta["model"]["path"]}}
    refused(path.parent, m, opt, no_id, "names its model without any of")


def test_weights_digest_samples_large_files(tmp_path, monkeypatch):
    """Above WHOLE_FILE_BYTES a file is read at its start (a safetensors header), middle and end: a change in a
    sample moves the digest, one between samples does not (the documented limit), and a size change always does."""
    from moe_lora_rl.checkpoint import model_identity as mi

    monkeypatch.setattr(mi, "WHOLE_FILE_BYTES", 1000)
    monkeypatch.setattr(mi, "SAMPLE_BYTES", 100)
    f = tmp_path / "model-00001-of-00001.safetensors"
    data = bytearray(range(256)) * 20                  # 5120 bytes: samples [0,100), [2510,2610), [5020,5120)
    f.write_bytes(bytes(data))
    base = mi.weights_digest(tmp_path)

    def flipped(at):
        d = bytearray(data)
        d[at] ^= 0x01
        f.write_bytes(bytes(d))
        return mi.weights_digest(tmp_path)

    assert all(flipped(at) != base for at in (0, 2550, 5119))
    assert flipped(1000) == base
    f.write_bytes(bytes(data) + b"x")
    assert mi.weights_digest(tmp_path) != base


def test_refuses_another_lora_config(saved, model_dir):
    _, _, _, path = saved
    for cfg, what in ((LoRAConfig(rank=8, alpha=16.0), "LoRA rank mismatch"),
                      (LoRAConfig(rank=4, alpha=4.0), "LoRA alpha mismatch"),
                      (LoRAConfig(rank=4, alpha=8.0, adapter_layout="shared"), "LoRA adapter_layout mismatch"),
                      (LoRAConfig(rank=4, alpha=8.0, targets=("experts",)), "LoRA targets mismatch")):
        m, opt = make(cfg)
        step(m, opt)
        refused(path.parent, m, opt, ck.describe_run(model_dir, cfg, "tp1ep1pp1"), what)
        with pytest.raises(ValueError, match=what):      # the main job's preflight: the manifest alone, no model
            ck.check_resume_lora(path.parent, cfg)
    ck.check_resume_lora(path.parent, saved[0].lora_config)       # the saved settings pass (init_seed aside)
    ck.check_resume_lora(path.parent, LoRAConfig(rank=4, alpha=8.0, init_seed=7))
    ck.check_resume_lora(path.parent.parent / "none", LoRAConfig(rank=8, alpha=16.0))   # nothing to resume


def test_layout_may_differ(saved):
    _, _, meta, path = saved
    state = ck.load_checkpoint(path.parent, *make(), run_meta={**meta, "layout": "tp2ep2"})
    assert state["step"] == 3


def test_refuses_shape_mismatch_before_copying(saved, model_dir):
    """A checkpoint whose manifest passes but whose tensors have other global shapes (another model under the
    same name) is refused by the read plan, with nothing copied."""
    _, _, meta, path = saved
    m, opt = trained()
    m.A.lora_meta = FactorMeta("layers.0.qkv.lora_A", (4, 7), None, None, ())
    refused(path.parent, m, opt, meta, "global shape")


def test_failed_rename_keeps_previous(saved, monkeypatch):
    m, opt, meta, path = saved
    step(m, opt)
    real = ck.os.rename

    def crash(src, dst):
        raise OSError("killed")
    monkeypatch.setattr(ck.os, "rename", crash)
    with pytest.raises(OSError, match=r"^checkpoint: cannot write .*step-00000004: killed$"):
        ck.save_checkpoint(path.parent, 4, m, opt, run_meta=meta, state={"step": 4})
    monkeypatch.setattr(ck.os, "rename", real)
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step-00000003"]      # rolled back
    assert ck.load_checkpoint(path.parent, *make(), run_meta=meta)["step"] == 3
    ck.save_checkpoint(path.parent, 4, m, opt, run_meta=meta, state={"step": 4})
    assert not list(path.parent.glob(".tmp-*")) and ck.latest_step(path.parent) == 4
    ck.save_checkpoint(path.parent, 4, m, opt, run_meta=meta, state={"step": 44})     # the same step again
    assert ck.load_checkpoint(path.parent, *make(), run_meta=meta)["step"] == 44
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "step-00000003", "step-00000004"]


def test_step_dir_loads_with_load_sharded(saved):
    from moe_lora_rl.lora.state import load_sharded

    m, _, _, path = saved
    fresh, _ = make()
    assert load_sharded(fresh, path) == 2 and torch.equal(fresh.B, m.B)


# ---- the reshard read plan (pure) -------------------------------------------------------------------------------

def pieces(n, total=8, dim=1):
    w = total // n
    return [Piece(f"f{i}", f"k{i}", (3, total), dim, i * w, (i + 1) * w) for i in range(n)]


@pytest.mark.parametrize("saved_n,want_n", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_plan_reshards(saved_n, want_n):
    full = torch.arange(24.0).reshape(3, 8)
    store = {p.key: full.narrow(1, p.start, p.stop - p.start) for p in pieces(saved_n)}
    w = 8 // want_n
    for r in range(want_n):
        out = torch.full((3, w), float("nan"))
        for rd in plan_reads("x", pieces(saved_n), (3, 8), 1, r * w, (r + 1) * w):
            out.narrow(1, rd.dst_lo, rd.n).copy_(store[rd.key].narrow(1, rd.src_lo, rd.n))
        assert torch.equal(out, full[:, r * w:(r + 1) * w])
    # a replicated target reads every slice
    assert sum(rd.n for rd in plan_reads("x", pieces(saved_n), (3, 8), None, 0, 3)) == 8


def test_plan_refusals():
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        plan_reads("x", [], (3, 8), 1, 0, 4)
    with pytest.raises(ValueError, match=r"entries \[4, 8\) of dim 1 are missing"):
        plan_reads("x", pieces(2)[:1], (3, 8), None, 0, 3)
    with pytest.raises(ValueError, match="global shape"):
        plan_reads("x", pieces(2), (3, 9), 1, 0, 4)
    with pytest.raises(ValueError, match="sharded on dim 1 in the checkpoint, the model shards dim 0"):
        plan_reads("x", pieces(2), (3, 8), 0, 0, 1)


def test_refuses_other_run_settings(tmp_path, model_dir):
    """Keys the caller adds to run_meta (seed, algorithm settings) must match exactly; a missing key too."""
    m, opt = trained()
    meta = ck.describe_run(model_dir, m.lora_config, "tp2ep2", seed=1, algo={"lr": 1e-3})
    ck.save_checkpoint(tmp_path / "c", 1, m, opt, run_meta=meta, state={})
    refused(tmp_path / "c", m, opt, {**meta, "seed": 2}, r"run_meta 'seed' mismatch: checkpoint 1, this run 2")
    refused(tmp_path / "c", m, opt, {**meta, "algo": {"lr": 1e-4}}, "run_meta 'algo' mismatch")
    refused(tmp_path / "c", m, opt, {k: v for k, v in meta.items() if k != "seed"}, "'seed' is only in the checkpoint")
    with pytest.raises(ValueError, match="has no config.json"):
        ck.describe_run(tmp_path, m.lora_config)


def test_prune_keeps_the_newest_and_latest(tmp_path, model_dir):
    m, opt = make()
    meta = ck.describe_run(model_dir, m.lora_config, "tp1ep1pp1")
    root = tmp_path / "ckpt"
    for s in (1, 2, 3, 4):
        step(m, opt)
        ck.save_checkpoint(root, s, m, opt, run_meta=meta, state={"version": s})
    assert ck.prune(root, 2) == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000003", "step-00000004"]
    (root / "latest").write_text("step-00000003\n")          # latest names an older step: it is never removed
    assert ck.prune(root, 1) == [] and ck.latest_step(root) == 3
    assert ck.load_checkpoint(root, m, opt, run_meta=meta)["version"] == 3
    with pytest.raises(ValueError, match="keep=0"):
        ck.prune(root, 0)


def _nan_save(root, step_n, m, opt, meta, monkeypatch):
    """A checkpoint holding NaN, written with the save's finite check switched off (what an unchecked save wrote)."""
    from moe_lora_rl.checkpoint import save as save_mod

    monkeypatch.setattr(save_mod, "non_finite", lambda *a: None, raising=False)
    try:
        return ck.save_checkpoint(root, step_n, m, opt, run_meta=meta, state={"step": step_n, "version": step_n})
    finally:
        monkeypatch.undo()


def test_save_refuses_non_finite_and_keeps_the_previous(saved):
    """NaN in an adapter factor, or inf in an AdamW moment: one ValueError naming the tensor; step-3 stays latest
    and loads with its values; no step-4 debris."""
    m, opt, meta, path = saved
    before = snapshot(m, opt)
    with torch.no_grad():
        m.B[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"step 4: adapter factor layers.0.qkv.lora_B holds nan: not saved") as e:
        ck.save_checkpoint(path.parent, 4, m, opt, run_meta=meta, state={"step": 4})
    assert "\n" not in str(e.value)
    with torch.no_grad():
        m.B[1, 0] = 0.0
    opt.state[m.A]["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"exp_avg_sq of adapter factor layers.0.qkv.lora_A holds inf"):
        ck.save_checkpoint(path.parent, 4, m, opt, run_meta=meta, state={"step": 4})
    assert ck.latest_step(path.parent) == 3 and sorted(p.name for p in path.parent.iterdir()) == ["latest", path.name]
    fresh, fopt = trained()
    ck.load_checkpoint(path.parent, fresh, fopt, run_meta=meta)
    assert torch.equal(fresh.B, before[0]["B"]) and torch.equal(fresh.A, before[0]["A"])


def test_load_refuses_non_finite_and_falls_back_to_the_newest_finite(saved, monkeypatch, capfd):
    """A NaN checkpoint (saved unchecked) as latest: the load names the tensor and the step and loads the newest
    finite one (step 3) instead; asked for that step explicitly: refused naming both; nothing finite: refused."""
    m, opt, meta, path = saved
    root = path.parent
    good = snapshot(m, opt)
    with torch.no_grad():
        m.A[0, 1] = float("nan")
    _nan_save(root, 4, m, opt, meta, monkeypatch)
    assert ck.latest_step(root) == 4
    fresh, fopt = trained()
    state = ck.load_checkpoint(root, fresh, fopt, run_meta=meta)
    assert state["step"] == 3 and torch.equal(fresh.A, good[0]["A"])
    err = capfd.readouterr().err
    assert "step 4: adapter factor layers.0.qkv.lora_A holds nan" in err and "loading step-00000003 instead" in err
    with pytest.raises(ValueError, match=r"step 4: adapter factor layers.0.qkv.lora_A holds nan: not loaded"):
        ck.load_checkpoint(root, *trained(), run_meta=meta, step=4)
    alone = root.parent / "alone"
    _nan_save(alone, 5, m, opt, meta, monkeypatch)
    with pytest.raises(ValueError, match=r"step 5: adapter factor layers.0.qkv.lora_A holds nan"):
        ck.load_checkpoint(alone, *trained(), run_meta=meta)


def test_a_checkpoint_a_restart_failed_on_is_never_loaded_again(saved):
    """resume: mark_resuming after the load; a start that finds the mark records that step as failed and loads the
    one before; when every checkpoint failed a restart, one line says so (torchrun's restarts end there)."""
    m, opt, meta, path = saved
    root = path.parent
    step(m, opt)
    ck.save_checkpoint(root, 4, m, opt, run_meta=meta, state={"step": 4})
    assert ck.record_failed_resume(root) is None                     # a first start: nothing to record
    ck.mark_resuming(root, ck.load_checkpoint(root, *trained(), run_meta=meta)["step"])    # resumed from 4 ...
    assert ck.record_failed_resume(root) == 4                        # ... and died: the next start records it
    assert ck.failed_steps(root) == [4] and ck.resumable_step(root) == 3
    ck.mark_resuming(root, ck.load_checkpoint(root, *trained(), run_meta=meta)["step"])
    ck.resume_succeeded(root)                                        # its first step went through
    assert ck.record_failed_resume(root) is None and ck.resumable_step(root) == 3
    ck.mark_resuming(root, 3)
    assert ck.record_failed_resume(root) == 3 and ck.resumable_step(root) is None
    with pytest.raises(ValueError, match=r"no checkpoint left to resume from: a restart failed on step\(s\) 4, 3") as e:
        ck.load_checkpoint(root, *trained(), run_meta=meta)
    assert "\n" not in str(e.value)


def test_main_job_resume_auto_ends_on_one_line_after_a_failed_restart(tmp_path, model_dir, monkeypatch, capfd):
    """The main job's resume=auto (GRPORun.resumes, one rank): resumes from step 3; the resumed start dies before
    its first step (the mark stays); the next start records step 3 as failed, says so on stderr, and with no other
    checkpoint refuses in one line (train.py's exit 2) instead of resuming into it again."""
    import types

    from moe_lora_rl.rl import run as run_mod
    from moe_lora_rl.rl import run_checkpoints

    monkeypatch.setattr(run_checkpoints, "broadcast", lambda obj, src=0: obj)
    m, opt = trained()
    meta = ck.describe_run(model_dir, m.lora_config)
    out = tmp_path / "run"
    ck.save_checkpoint(out / "checkpoints", 3, m, opt, run_meta=meta, state={"step": 3})
    job = types.SimpleNamespace(rank=0, cfg=types.SimpleNamespace(resume="auto"), out=out)
    assert run_mod.GRPORun.resumes(job) is True
    ck.mark_resuming(out / "checkpoints", 3)                       # GRPORun.resume after its load; then it died
    with pytest.raises(ValueError, match=r"resume=auto: no checkpoint left to resume from .* step\(s\) 3") as e:
        run_mod.GRPORun.resumes(job)
    assert "\n" not in str(e.value)
    assert "failed after resuming from step 3" in capfd.readouterr().err
