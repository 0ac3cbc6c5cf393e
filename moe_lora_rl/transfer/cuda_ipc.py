"""A bucket handed to an engine on the same GPU as a CUDA IPC handle (base transport ipc; GPU only): the sender
keeps the bucket in device memory and passes its handle in the update info; the engine opens the handle, copies the
bytes into its own memory and checks their digest on a host copy.

    handle = share(bucket)                    # the sender: a 1-D uint8 CUDA tensor -> a JSON string
    data = open_shared(handle, device)        # the engine: a view of the sender's memory (copy it before use)

The handle carries torch's own CUDA IPC arguments (torch.multiprocessing.reductions.reduce_tensor, as vLLM's IPC
weight-transfer engine uses them), as JSON with the byte handles in base64, never a pickle: an update info arrives
over the engine's RPC. Written against those documented APIs; CUDA only, and not run on the CPU machines that test
this project.
"""
from __future__ import annotations

import base64
import json

import torch


def _b64(x: bytes | None) -> str | None:
    return None if x is None else base64.b64encode(x).decode("ascii")


def _raw(x: str | None) -> bytes | None:
    return None if x is None else base64.b64decode(x)


def share(t: torch.Tensor) -> str:
    """The CUDA IPC handle of a 1-D uint8 CUDA tensor, as JSON; the caller keeps `t` alive until the engine copied
    it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type != "cuda" or t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"a CUDA IPC bucket is a 1-D uint8 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    _, a = reduce_tensor(t)
    storage = a[4].__name__
    if storage not in ("TypedStorage", "UntypedStorage"):
        raise ValueError(f"CUDA IPC: unexpected storage class {storage}")
    return json.dumps({"uuid": str(torch.cuda.get_device_properties(t.device).uuid), "size": list(a[1]),
                       "stride": list(a[2]), "offset": int(a[3]), "storage": storage, "handle": _b64(a[7]),
                       "storage_size": int(a[8]), "storage_offset": int(a[9]), "ref_handle": _b64(a[11]),
                       "ref_offset": int(a[12]), "event_handle": _b64(a[13]), "event_sync": bool(a[14])})


def open_shared(handle: str, device) -> torch.Tensor:
    """The sender's bucket as a tensor on this process's `device` (the same GPU as the sender's); ValueError naming
    what does not fit (a malformed handle, another GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError("a CUDA IPC bucket, but this engine has no CUDA (use shm, gloo or http on CPU)")
    try:
        h = json.loads(handle)
        storage = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}[h["storage"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed CUDA IPC handle ({type(e).__name__}: {e})") from None
    dev = torch.device(device)
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    if h["uuid"] != uuid:
        raise ValueError(f"CUDA IPC handle of GPU {h['uuid']}, this engine runs on GPU {uuid}: a handle opens on the "
                         "sender's GPU only (use nccl between GPUs)")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], storage,
                               torch.uint8, dev.index, _raw(h["handle"]), h["storage_size"], h["storage_offset"],
                               False, _raw(h["ref_handle"]), h["ref_offset"], _raw(h["event_handle"]),
                               h["event_sync"])
