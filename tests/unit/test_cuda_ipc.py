"""The base's CUDA IPC handoff (transfer/cuda_ipc.py): a bucket shared as a JSON handle opens in another process
on the same GPU with the same bytes; a handle for another GPU and a malformed one are refused. GPU only: skipped
here (no machine that tests this project has CUDA; scripts/gpu_check.sh's ipc part runs the adapters' handoff)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; this machine has none")


def _open_and_copy(handle, q):
    from moe_lora_rl.transfer.cuda_ipc import open_shared

    # plain bytes: a CPU tensor put on the queue would be shared through this process's resource sharer, which is
    # gone once it exits
    q.put(open_shared(handle, "cuda:0").cpu().numpy().tobytes())


def test_a_bucket_opens_in_another_process_with_its_bytes():
    import json

    import torch.multiprocessing as mp

    from moe_lora_rl.transfer.cuda_ipc import open_shared, share

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dev = data.cuda()
    handle = share(dev)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_open_and_copy, args=(handle, q))
    p.start()
    got = q.get(timeout=120)
    p.join(60)
    assert got == data.numpy().tobytes()
    with pytest.raises(ValueError, match="malformed CUDA IPC handle"):
        open_shared("{}", "cuda:0")
    with pytest.raises(ValueError, match="a handle opens on the sender's GPU only"):
        open_shared(json.dumps({**json.loads(handle), "uuid": "GPU-other"}), "cuda:0")
