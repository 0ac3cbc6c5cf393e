"""Where the rollout engine runs: rank 0's host by default (shared memory), another slurm node over HTTP."""
import pytest

from moe_lora_rl.rl import config
from moe_lora_rl.rollout.placement import plan_placement


def test_same_host_uses_shared_memory():
    for node in (None, "n1", "localhost"):
        p = plan_placement(node=node, gpus=[], this_host="n1")
        assert p.launcher == () and p.transport == "shm" and p.connect_host == "127.0.0.1" and p.watch_parent
    assert plan_placement(node=None, gpus=[6, 7], this_host="n1").env == {"CUDA_VISIBLE_DEVICES": "6,7"}


def test_other_node_is_srun_and_http():
    p = plan_placement(node="gpu-node-02", gpus=[0, 1, 2, 3], this_host="gpu-node-01")
    assert p.launcher == ("srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-node-02", "--gpus-per-node=4")
    assert (p.bind_host, p.connect_host, p.transport, p.watch_parent) == ("0.0.0.0", "gpu-node-02", "http", False)
    assert p.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    cpu = plan_placement(node="cpu-node-02", gpus=[], this_host="cpu-node-01")   # asks for no GPU, even in a GPU job
    assert cpu.launcher[-1] == "--gpus-per-node=0" and cpu.env == {} and cpu.transport == "http"


def test_bad_placement_is_named():
    with pytest.raises(ValueError, match=r"rollout.gpus=\[1, 1\]"):
        plan_placement(node=None, gpus=[1, 1], this_host="a")
    with pytest.raises(ValueError, match="rollout.node='a;rm'"):
        plan_placement(node="a;rm", gpus=[], this_host="b")
    with pytest.raises(ValueError, match="rollout.gpus"):
        config.load(["rollout.gpus=[-1]"])
    assert config.load(["rollout.node=n3", "rollout.gpus=[0,1]"]).rollout.gpus == [0, 1]
