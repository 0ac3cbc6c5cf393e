"""How the base travels to an engine by where it runs (rollout/base.py): auto is shared memory on this host and
inline http on another; the refusals name the setting (shared memory to another host, a bucket whose inline body
exceeds the engine's limit, an unknown transport); gloo's store is reached on loopback only when every engine runs
here."""
import pytest

from moe_lora_rl.rollout.base import check_base_transport, gloo_host, resolve_peer_transport, resolve_transport
from moe_lora_rl.rollout.placement import plan_placement

HERE = plan_placement(node=None, gpus=[], this_host="h0")
THERE = plan_placement(node="n1", gpus=[], this_host="h0")


def test_auto_follows_the_placement_and_explicit_settings_stay():
    assert resolve_transport("auto", HERE) == "shm"
    assert resolve_transport("auto", THERE) == "http"
    for t in ("shm", "http", "gloo"):
        assert resolve_transport(t, HERE) == t
    assert gloo_host([HERE, HERE]) == "127.0.0.1"
    assert gloo_host([HERE, THERE]) not in ("127.0.0.1", "")


def test_a_peer_join_maps_shared_memory_only_when_both_engines_run_here():
    for setting in ("auto", "shm", "gloo"):
        assert resolve_peer_transport(setting, HERE, HERE) == "shm"
        assert resolve_peer_transport(setting, HERE, THERE) == resolve_peer_transport(setting, THERE, HERE) == "http"
    assert resolve_peer_transport("http", HERE, HERE) == "http"          # asked inline: inline, even here


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="base_transport='shm' for an engine on n1"):
        check_base_transport("trainer", "shm", 64, THERE, None)
    with pytest.raises(ValueError, match="base_transport='nccl'"):
        check_base_transport("trainer", "nccl", 64, HERE, None)
    # 400 MiB buckets inline are ~534 MiB of body, over the default 512 MiB; allowed with a larger limit
    with pytest.raises(ValueError, match="base_bucket_mb=400: .* limit of 512 MiB"):
        check_base_transport("peer", "auto", 400, THERE, None)
    check_base_transport("peer", "auto", 400, THERE, 1024)
    check_base_transport("peer", "auto", 400, HERE, None)          # shared memory: no body
    check_base_transport("disk", "shm", 400, THERE, None)          # nothing travels
    for t in ("http", "gloo", "auto"):
        check_base_transport("trainer", t, 64, THERE, None)


def test_verl_base_backend_picks_the_transport_by_the_servers_host():
    pytest.importorskip("verl", reason="verl is installed only in the main (Python 3.11) venv")
    from moe_lora_rl.integration.verl.checkpoint_engine import MoELoRABaseCheckpointEngine

    ck = MoELoRABaseCheckpointEngine(server_urls=["http://127.0.0.1:8000", "http://node7:8000"])
    assert [ck.transport_for(t) for t in ck.transports] == ["shm", "http"]
    ck = MoELoRABaseCheckpointEngine(server_urls=["http://127.0.0.1:8000"], base_transport="http")
    assert [ck.transport_for(t) for t in ck.transports] == ["http"]
    with pytest.raises(ValueError, match="base_transport='gloo'"):
        MoELoRABaseCheckpointEngine(base_transport="gloo")


def test_ipc_needs_the_same_host_gpus_and_cuda():
    """ipc: refused for an engine on another node or given no GPU; without CUDA the sender, and an engine opening a
    handle, refuse in one line (the IPC path itself runs only where a GPU is lent)."""
    import torch

    from moe_lora_rl.transfer.cuda_ipc import open_shared
    from moe_lora_rl.transfer.shm_sender import send_store

    gpu = plan_placement(node=None, gpus=[0], this_host="h0")
    with pytest.raises(ValueError, match="base_transport='ipc' for an engine given no GPU"):
        check_base_transport("peer", "ipc", 64, HERE, None)
    with pytest.raises(ValueError, match="base_transport='ipc' for an engine on n1: a CUDA IPC handle"):
        check_base_transport("trainer", "ipc", 64, plan_placement(node="n1", gpus=[0], this_host="h0"), None)
    check_base_transport("trainer", "ipc", 64, gpu, None)
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the refusals below are for machines without it")
    with pytest.raises(ValueError, match="'ipc' needs CUDA in this process"):
        send_store(lambda *a: None, None, transport="ipc")
    with pytest.raises(ValueError, match="this engine has no CUDA"):
        open_shared("{}", "cuda:0")


def test_nccl_needs_gpus_and_cuda():
    """nccl: refused for an engine given no GPU, in one line; the sender and a group member refuse without CUDA
    (this machine has none: the NCCL path itself runs only where a GPU is lent)."""
    import torch

    from moe_lora_rl.transfer import gloo_bucket
    from moe_lora_rl.transfer.gloo_sender import GlooBroadcast

    with pytest.raises(ValueError, match="base_transport='nccl' for an engine given no GPU"):
        check_base_transport("trainer", "nccl", 64, HERE, None)
    check_base_transport("trainer", "nccl", 64, plan_placement(node=None, gpus=[0], this_host="h0"), None)
    check_base_transport("disk", "nccl", 64, HERE, None)                 # nothing travels
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the refusals below are for machines without it")
    with pytest.raises(ValueError, match="'nccl' needs CUDA in this process"):
        GlooBroadcast([lambda *a: None], backend="nccl")
    with pytest.raises(ValueError, match="'nccl' needs CUDA in every process"):
        gloo_bucket.join_nccl("127.0.0.1", 1, 1, 2, 1.0, "k" * 32, device="cuda:0")
    with pytest.raises(ValueError, match="backend='ucx'"):
        GlooBroadcast([lambda *a: None], backend="ucx")
