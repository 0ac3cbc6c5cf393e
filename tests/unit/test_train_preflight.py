"""The driver refuses a bad run before any process group or engine starts: one line naming the value, exit 2."""
import subprocess
import sys

import pytest

from moe_lora_rl.rl import config, preflight


def check(overrides, world):
    return preflight.check(config.load(overrides), world)


def test_layout_against_world_and_model():
    with pytest.raises(ValueError, match="world size"):
        check(["layout.tp=2", "layout.ep=2"], 1)
    with pytest.raises(ValueError, match="ep=3"):
        check(["layout.ep=3"], 3)               # 16 experts do not split over 3
    with pytest.raises(ValueError, match="micro_batch_size=16"):
        check(["algo.group_size=4", "algo.prompts_per_step=6"], 2)  # 24 responses, 2 DP ranks x 16
    arch = check([], 2)
    assert arch.num_experts == 16 and any(arch.moe_layers)


def test_async_refusals():
    for overrides, world, needle in (
            (["mode=async", "max_staleness=0"], 2, "max_staleness=0"),
            (["mode=async", "inflight=pin", "serving=merged"], 2, "inflight=pin with serving=merged"),
            (["mode=async", "inflight=pin", "max_staleness=4"], 2, "rollout.max_versions=4"),
            (["mode=async", "algo.group_size=3", "algo.prompts_per_step=3", "algo.micro_batch_size=1"], 2,
             "does not split over data-parallel size 2"),
            (["mode=async", "delay.train_s=-1"], 2, "delay.train_s=-1")):
        with pytest.raises(ValueError, match=needle):
            check(overrides, world)
    check(["mode=async", "inflight=pin", "max_staleness=3"], 2)          # 4 versions fit rollout.max_versions=4
    assert config.load(["mode=async", "max_staleness=0", "mode=sync"]).mode == "sync"  # the bound is async's only


def test_cli_one_line_errors():
    for args, needle in ((["lora.rnk=4"], "unknown config key"), (["replay=r4"], "replay='r4'"),
                         (["data.train_file=/nonexistent.parquet"], "/nonexistent.parquet"),
                         (["mode=async", "max_staleness=0"], "max_staleness=0")):
        p = subprocess.run([sys.executable, "-m", "moe_lora_rl.train", *args], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
