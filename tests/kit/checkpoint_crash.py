"""What the checkpoint tests share: a stand-in LoRA model (two adapter factors with their sharding metadata, which is
all a checkpoint reads), `in_child` (run a save in a forked process that an injected crash point may kill), and the
2-rank gloo worker checking that ranks agree on failed saves and on fallbacks:

    python -m torch.distributed.run --nproc_per_node=2 -m kit.checkpoint_crash --out DIR --result F

A fork starts in milliseconds with the parent's model and optimizer as they are; a fresh interpreter would spend
3 s importing torch for each of the crash points.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from moe_lora_rl.lora.config import LoRAConfig
from moe_lora_rl.lora.layers import FactorMeta, make_factor

X = torch.linspace(-1, 1, 24).reshape(4, 6)


class Toy(nn.Module):
    def __init__(self, cfg: LoRAConfig, seed: int = 0):
        super().__init__()
        self.lora_config = cfg
        r = cfg.rank
        self.A = make_factor(FactorMeta("layers.0.qkv.lora_A", (r, 6), None, None, ()), 0, 1, init="kaiming",
                             seed=seed, dtype=torch.float32)
        self.B = make_factor(FactorMeta("layers.0.qkv.lora_B", (2, 5, r), 1, None, (), glu=True), 0, 1,
                             init="zeros", seed=seed, dtype=torch.float32)

    def loss(self, x):
        return ((x @ self.A.t() @ self.B.t()) - 1.0).pow(2).mean()


def step(model, opt):
    opt.zero_grad()
    model.loss(X).backward()
    opt.step()


def make(cfg=LoRAConfig(rank=4, alpha=8.0), lr=0.05):
    m = Toy(cfg)
    return m, torch.optim.AdamW([m.A, m.B], lr=lr, weight_decay=0.01)


def adapters(m) -> dict[str, torch.Tensor]:
    return {"A": m.A.detach().clone(), "B": m.B.detach().clone()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def in_child(fn, env: dict[str, str] | None = None, timeout: float = 60.0) -> int:
    """Run fn() in a forked child with ENV added to its environment; its exit status (0: returned, 1: raised,
    store.CRASH_EXIT: killed at a crash point). A child still running after `timeout` is killed (status -9)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.environ.update(env or {})
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.005)


def flip_byte(f: Path) -> None:
    """Same size, the last byte's lowest bit flipped (a tensor's value: only the checksum can tell)."""
    b = bytearray(f.read_bytes())
    b[-1] ^= 0x01
    f.write_bytes(bytes(b))


# ---- the 2-rank worker ------------------------------------------------------------------------------------------

def _two_ranks(out: Path) -> dict:
    """Rank 1's disk fills mid-save, then rank 0 fails in its own phase: both ranks raise the same error (none
    hangs) and load step 1; a save then succeeds; rank 0 damages a file only rank 1 hashes: both fall back."""
    import safetensors.torch
    import torch.distributed as dist

    from moe_lora_rl.checkpoint import api as ck
    from moe_lora_rl.checkpoint.directory import CRASH_ENV, MANIFEST

    rank = dist.get_rank()
    root = out / "ckpt"
    model_dir = out / "model"
    if rank == 0:
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({"hidden_size": 6}))
    dist.barrier()
    m, opt = make()
    meta = ck.describe_run(model_dir, m.lora_config)
    step(m, opt)
    ck.save_checkpoint(root, 1, m, opt, run_meta=meta, state={"tag": f"v1-{rank}"})
    v1 = adapters(m)
    step(m, opt)
    r: dict = {}

    real = safetensors.torch.save_file

    def full(tensors, filename, metadata=None):
        if rank == 1 and filename.endswith("optim-00001.safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(tensors, filename, metadata=metadata)
    safetensors.torch.save_file = full
    try:
        ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": f"v2-{rank}"})
    except OSError as e:
        r["enospc"] = f"{type(e).__name__}: {e}"
    safetensors.torch.save_file = real

    os.environ[CRASH_ENV] = "before_manifest:raise:rank0"
    try:
        ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": f"v2-{rank}"})
    except Exception as e:
        r["rank0_phase"] = f"{type(e).__name__}: {e}"
    del os.environ[CRASH_ENV]
    r["listing"] = sorted(p.name for p in root.iterdir())
    fresh, fopt = make()
    r["after_failures"] = [ck.load_checkpoint(root, fresh, fopt, run_meta=meta)["tag"], equal(adapters(fresh), v1)]

    ck.save_checkpoint(root, 2, m, opt, run_meta=meta, state={"tag": f"v2-{rank}"})
    v2 = adapters(m)
    fresh, fopt = make()
    r["control"] = [ck.load_checkpoint(root, fresh, fopt, run_meta=meta)["tag"], equal(adapters(fresh), v2)]
    dist.barrier()
    names = sorted(json.loads((root / "step-00000002" / MANIFEST).read_text())["files"])
    r["damaged"] = names[1]                          # store._stage hashes names[i] on rank i % world
    if rank == 0:
        flip_byte(root / "step-00000002" / names[1])
    dist.barrier()
    fresh, fopt = make()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        r["fallback"] = [ck.load_checkpoint(root, fresh, fopt, run_meta=meta)["tag"], equal(adapters(fresh), v1)]
    r["fallback_err"] = err.getvalue().splitlines()
    return r


def main(argv=None) -> None:
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mine = _two_ranks(Path(a.out))
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    if dist.get_rank() == 0:
        Path(a.result).write_text(json.dumps({"ranks": everything}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)       # 1 run in ~10 aborted in interpreter teardown ("terminate called without an active exception")


if __name__ == "__main__":
    main()
