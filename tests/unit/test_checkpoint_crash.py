"""Crash-consistent checkpoints (checkpoint/api.py): a kill (os._exit in a forked child) at every named crash point
of a save leaves the previous checkpoint as the one loaded, bit for bit, until the commit; the next save tidies the
debris. A damaged latest falls back to the previous one with one line on stderr; a refusal never falls back; a full
disk is one OSError naming the file with the previous checkpoint intact. 2 gloo ranks agree on both (torchrun).

Values: step 1 saves adapters v1, the save under test holds v2 (one AdamW step later, |v2 - v1| > 0 checked), the next
save v3; "loads v1" means torch.equal on both factors and the saved state's tag. Control: the same child without a
crash point loads v2, so the assertions can tell the two apart.
"""
import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

from moe_lora_rl.checkpoint import api as ck
from moe_lora_rl.checkpoint.directory import (CRASH_ENV, CRASH_POINTS, IntegrityError, MANIFEST, crash_action,
                                              plan_candidates, plan_cleanup)
from kit.checkpoint_crash import adapters, equal, flip_byte, in_child, make, step

# where a kill has committed the save: a new step at the `latest` rename, the same step again at the step-N rename
COMMITTED = {"new": {"before_cleanup"}, "same": {"before_latest", "before_cleanup"}}
KILLS = [("new", p) for p in CRASH_POINTS if p != "mid_replace"] + [("same", p) for p in CRASH_POINTS]
ENOSPC = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"


@pytest.fixture
def run(tmp_path):
    """Step 1 saved (v1); the model one step further (v2)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 6}))
    m, opt = make()
    step(m, opt)
    meta = ck.describe_run(model_dir, m.lora_config)
    root = tmp_path / "ckpt"
    ck.save_checkpoint(root, 1, m, opt, run_meta=meta, state={"tag": "v1"})
    v1 = adapters(m)
    step(m, opt)
    v2 = adapters(m)
    assert min((v2[k] - v1[k]).abs().max().item() for k in v1) > 1e-4
    return m, opt, meta, root, v1, v2


def loaded(root, meta, step=None) -> tuple[str, dict]:
    fresh, fopt = make()
    state = ck.load_checkpoint(root, fresh, fopt, run_meta=meta, step=step)
    return state["tag"], adapters(fresh)


def listing(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("scenario,point", KILLS)
def test_kill_at_crash_point(run, scenario, point, capfd):
    m, opt, meta, root, v1, v2 = run
    target = 2 if scenario == "new" else 1
    code = in_child(lambda: ck.save_checkpoint(root, target, m, opt, run_meta=meta, state={"tag": "v2"}),
                    {CRASH_ENV: f"{point}:exit"})
    assert code == ck.CRASH_EXIT, f"the child was not killed at {point} (exit status {code})"
    committed = point in COMMITTED[scenario]
    want_tag, want = ("v2", v2) if committed else ("v1", v1)
    assert ck.resumable_step(root) == (target if committed else 1)
    capfd.readouterr()
    tag, got = loaded(root, meta)
    assert tag == want_tag and equal(got, want), (tag, want_tag)
    err = capfd.readouterr().err.splitlines()
    if point == "mid_replace":                         # step-1 moved aside, its replacement not yet in place
        assert len(err) == 1 and re.fullmatch(rf"checkpoint: {re.escape(str(root / 'step-00000001'))}: no such "
                                              r"checkpoint directory; loading \.old-step-00000001 instead", err[0])
    else:
        assert err == []

    step(m, opt)                                       # the resumed run's next checkpoint: tidies the debris
    v3 = adapters(m)
    ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": "v3"})
    assert listing(root) == ["latest", "step-00000001", "step-00000002"]
    tag, got = loaded(root, meta)
    assert tag == "v3" and equal(got, v3)
    tag, got = loaded(root, meta, step=1)              # a resave's old copy was put back where it was killed
    assert (tag, equal(got, v2 if scenario == "same" and committed else v1)) == \
        ("v2" if scenario == "same" and committed else "v1", True)


@pytest.mark.parametrize("target", [2, 1])
def test_uncrashed_child_loads_the_new_values(run, target):
    """Control for the kills: the same child with no crash point (and one naming another rank) saves v2."""
    m, opt, meta, root, v1, v2 = run
    assert in_child(lambda: ck.save_checkpoint(root, target, m, opt, run_meta=meta, state={"tag": "v2"}),
                    {CRASH_ENV: "before_manifest:exit:rank1"}) == 0
    tag, got = loaded(root, meta)
    assert tag == "v2" and equal(got, v2) and not equal(got, v1)
    assert listing(root) == ["latest"] + [f"step-0000000{s}" for s in sorted({1, target})]
    assert ck.resumable_step(root) == target


@pytest.mark.parametrize("scenario,point", KILLS)
def test_raise_at_crash_point_rolls_back(run, scenario, point):
    """A failure (raise mode) is rolled back in the same process: nothing but the committed save changes."""
    m, opt, meta, root, v1, v2 = run
    target = 2 if scenario == "new" else 1
    os.environ[CRASH_ENV] = f"{point}:raise"
    try:
        with pytest.raises(RuntimeError, match=rf"^checkpoint: cannot write \S+: RuntimeError: injected crash at "
                                               rf"{point}$"):
            ck.save_checkpoint(root, target, m, opt, run_meta=meta, state={"tag": "v2"})
    finally:
        del os.environ[CRASH_ENV]
    committed = point == "before_cleanup"
    tag, got = loaded(root, meta)
    assert (tag, equal(got, v2 if committed else v1)) == ("v2" if committed else "v1", True)
    if not committed:
        assert listing(root) == ["latest", "step-00000001"]


def test_crash_spec():
    assert crash_action(None, "before_rename", 0) is None and crash_action("", "before_rename", 0) is None
    assert crash_action("before_rename", "before_rename", 3) == "exit"
    assert crash_action("before_rename:raise", "before_rename", 0) == "raise"
    assert crash_action("before_rename:exit:rank1", "before_rename", 1) == "exit"
    assert crash_action("before_rename:exit:rank1", "before_rename", 0) is None
    assert crash_action("before_rename", "before_latest", 0) is None
    with pytest.raises(ValueError, match=r"unknown crash point 'before_renmae'"):
        crash_action("before_renmae", "before_rename", 0)
    with pytest.raises(ValueError, match=r"option 'kill' is none of"):
        crash_action("before_rename:kill", "before_rename", 0)


def test_crash_env_read_at_call_time(monkeypatch):
    ck._crash_point("before_shards")                   # unset: nothing
    monkeypatch.setenv(CRASH_ENV, "before_shards:raise")
    with pytest.raises(RuntimeError, match="injected crash at before_shards"):
        ck._crash_point("before_shards")
    ck._crash_point("after_shards")
    monkeypatch.setenv(CRASH_ENV, "before_shards:raise:rank1")
    ck._crash_point("before_shards")                   # this process is rank 0


# ---- a damaged latest -------------------------------------------------------------------------------------------

def damage(kind: str, ckpt: Path) -> str:
    """Damage step-2 one way; what the fallback line must say."""
    if kind == "flipped byte":
        flip_byte(ckpt / "adapter-00000.safetensors")
        return f"checkpoint file {ckpt / 'adapter-00000.safetensors'} fails its checksum"
    if kind == "truncated state":
        f = ckpt / "state-00000.pt"
        f.write_bytes(f.read_bytes()[:-3])
        return f"checkpoint file {f} is truncated or altered"
    if kind == "manifest unreadable":
        (ckpt / MANIFEST).write_text('{"format": ')
        return f"{ckpt / MANIFEST}: unreadable"
    if kind == "manifest missing":
        (ckpt / MANIFEST).unlink()
        return f"{ckpt / MANIFEST}: missing, the checkpoint is incomplete"
    import shutil
    shutil.rmtree(ckpt)
    return f"{ckpt}: no such checkpoint directory"


@pytest.mark.parametrize("kind", ["flipped byte", "truncated state", "manifest unreadable", "manifest missing",
                                  "directory removed"])
def test_damaged_latest_falls_back(run, kind, capfd):
    m, opt, meta, root, v1, v2 = run
    ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": "v2"})
    ck.save_checkpoint(root, 3, m, opt, run_meta=meta, state={"tag": "v2"})
    (root / "step-00000002" / MANIFEST).unlink()       # an incomplete one between: skipped silently
    capfd.readouterr()
    tag, got = loaded(root, meta)
    assert tag == "v2" and equal(got, v2) and capfd.readouterr().err == ""       # control: undamaged
    why = damage(kind, root / "step-00000003")
    assert ck.resumable_step(root) == (3 if kind in ("flipped byte", "truncated state") else 1)   # manifests only
    tag, got = loaded(root, meta)
    assert tag == "v1" and equal(got, v1)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"checkpoint: {why}") and \
        err[0].endswith("; loading step-00000001 instead"), err


def test_damaged_latest_without_previous(run):
    _, _, meta, root, _, _ = run
    flip_byte(root / "step-00000001" / "optim-00000.safetensors")
    with pytest.raises(IntegrityError, match=re.escape(str(root / "step-00000001" / "optim-00000.safetensors"))) as e:
        loaded(root, meta)
    assert "\n" not in str(e.value) and ck.resumable_step(root) == 1


def test_refusal_never_falls_back(run, capfd):
    m, opt, meta, root, _, _ = run
    ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": "v2"})
    flip_byte(root / "step-00000002" / "adapter-00000.safetensors")     # damaged and of another run: a refusal
    for other in ({**meta, "seed": 1}, {**meta, "lora": {**meta["lora"], "rank": 8}}):
        with pytest.raises(ValueError, match=r"step-00000002: (run_meta key 'seed' is only in this run|LoRA rank)") \
                as e:
            loaded(root, other)
        assert not isinstance(e.value, IntegrityError)
    assert capfd.readouterr().err == ""


# ---- a full disk ------------------------------------------------------------------------------------------------

def _full(monkeypatch, writer: str):
    """Make one writer fail with ENOSPC; the path it was writing."""
    import safetensors.torch

    if writer == "optimizer shard":
        real = safetensors.torch.save_file

        def save_file(tensors, filename, metadata=None):
            if filename.endswith("optim-00000.safetensors"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(tensors, filename, metadata=metadata)
        monkeypatch.setattr(safetensors.torch, "save_file", save_file)
        return ".tmp-step-0000000{}/optim-00000.safetensors"
    if writer == "state":
        def save(obj, f, *a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(torch, "save", save)
        return ".tmp-step-0000000{}/state-00000.pt"
    name = {"manifest": MANIFEST, "latest pointer": ".latest.tmp"}[writer]
    real_write = Path.write_text

    def write_text(self, *a, **k):
        if self.name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, *a, **k)
    monkeypatch.setattr(Path, "write_text", write_text)
    return ".latest.tmp" if name == ".latest.tmp" else ".tmp-step-0000000{}/manifest.json"


@pytest.mark.parametrize("target", [2, 1])
@pytest.mark.parametrize("writer", ["optimizer shard", "state", "manifest", "latest pointer"])
def test_disk_full(run, writer, target, monkeypatch):
    m, opt, meta, root, v1, v2 = run
    with monkeypatch.context() as mp:
        path = root / _full(mp, writer).format(target)
        with pytest.raises(OSError) as e:
            ck.save_checkpoint(root, target, m, opt, run_meta=meta, state={"tag": "v2"})
    assert str(e.value) == f"checkpoint: cannot write {path}: {ENOSPC}"
    assert listing(root) == ["latest", "step-00000001"]                   # no .tmp, no .old, no .latest.tmp
    tag, got = loaded(root, meta)
    assert tag == "v1" and equal(got, v1)
    ck.save_checkpoint(root, target, m, opt, run_meta=meta, state={"tag": "v2"})   # space again: it saves
    tag, got = loaded(root, meta)
    assert tag == "v2" and equal(got, v2)


# ---- the pure plans ---------------------------------------------------------------------------------------------

def test_plan_candidates():
    complete = {"step-00000001", "step-00000003", "step-00000005", ".old-step-00000003", ".tmp-step-00000004",
                "notes"}
    assert plan_candidates("step-00000003", complete) == ["step-00000003", ".old-step-00000003", "step-00000001"]
    assert plan_candidates("step-00000004", complete) == ["step-00000004", "step-00000003", "step-00000001"]
    assert plan_candidates("garbage", complete) == ["garbage", "step-00000005", "step-00000003", "step-00000001"]
    assert plan_candidates(None, complete) == []


def test_plan_cleanup():
    entries = {"latest": False, ".latest.tmp": False, ".tmp-step-00000004": True, "step-00000001": True,
               ".old-step-00000001": True,                    # step-1 complete again: the old copy goes
               ".old-step-00000002": True,                    # step-2 missing: killed mid-replace, put back
               ".old-step-00000003": True, "step-00000003": False,   # an incomplete step-3 in the way
               "step-00000006": False,                        # no manifest, not latest: debris
               "step-00000007": False,                        # no manifest but latest names it: kept
               ".old-step-00000008": False, "notes.txt": False}
    assert plan_cleanup(entries, "step-00000007") == [
        ("remove", ".latest.tmp"), ("remove", ".old-step-00000001"), ("restore", ".old-step-00000002", "step-00000002"),
        ("remove", "step-00000003"), ("restore", ".old-step-00000003", "step-00000003"),
        ("remove", ".old-step-00000008"), ("remove", ".tmp-step-00000004"), ("remove", "step-00000006")]


# ---- two gloo ranks ---------------------------------------------------------------------------------------------

@pytest.mark.dist
def test_two_ranks_agree(tmp_path):
    """Rank 1's disk fills: both ranks raise the same OSError naming rank 1's file (neither hangs in a collective);
    rank 0 fails alone: both raise its error; both still load step 1 (each its own state). Rank 0 damages a file
    only rank 1 hashes: both fall back to step 1, and one line is printed (rank 0)."""
    from moe_lora_rl.checks.torchrun import run_torchrun

    rep = run_torchrun("kit.checkpoint_crash", 2, ["--out", str(tmp_path)], timeout=300)
    r0, r1 = rep["ranks"]
    tmp = tmp_path / "ckpt" / ".tmp-step-00000002"
    assert r0["enospc"] == r1["enospc"] == f"OSError: checkpoint: cannot write {tmp / 'optim-00001.safetensors'}: " \
                                           f"{ENOSPC}"
    assert r0["rank0_phase"] == r1["rank0_phase"] == f"RuntimeError: checkpoint: cannot write " \
        f"{tmp_path / 'ckpt' / 'step-00000002'}: RuntimeError: injected crash at before_manifest"
    assert r0["listing"] == r1["listing"] == ["latest", "step-00000001"]
    assert (r0["after_failures"], r1["after_failures"]) == (["v1-0", True], ["v1-1", True])
    assert (r0["control"], r1["control"]) == (["v2-0", True], ["v2-1", True])
    assert r0["damaged"] == "adapter-00001.safetensors"
    assert (r0["fallback"], r1["fallback"]) == (["v1-0", True], ["v1-1", True])
    damaged = tmp_path / "ckpt" / "step-00000002" / "adapter-00001.safetensors"
    assert r1["fallback_err"] == [] and len(r0["fallback_err"]) == 1, (r0["fallback_err"], r1["fallback_err"])
    assert r0["fallback_err"][0].startswith(f"checkpoint: checkpoint file {damaged} fails its checksum") and \
        r0["fallback_err"][0].endswith("; loading step-00000001 instead")
