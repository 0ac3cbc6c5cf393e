"""The transfer layer: how weights travel from a sender to rollout engines, for the adapters' refit and for the
full-weight (base) sync alike. It knows tensors, buckets and engines, not LoRA (refit/ gathers and names the
adapters, then pushes through a Transport).

    interface.py     the Transport protocol (call, send_bucket, reset_prefix_cache) every transport and wrapper
                     implements, TransportBase (the staged push on it), PushResult, RefitError, BUCKET_BYTES
    transports.py    in-process, HTTP, shared-memory and CUDA IPC transports of an adapter push
    push_plan.py     pure: the buckets of one push of named tensors (layer-major, within bucket_bytes)
    wire.py          pure: checksums, blob and buffer encodings (also read by the vLLM plugin)
    shm.py           shared-memory segments: write, map, digest, the pool, stale segments removed
    gloo_bucket.py   a bucket broadcast over a gloo (or NCCL) group with agreement before and after
    base_buckets.py  pure: the bucket plan of a full-weight sync (owners, pieces, alignment)
    base_store.py    the sender's base in shared-memory segments, written once, sent to any engine
    shm_sender.py    the full-weight sync to one engine over vLLM's weight-transfer calls (shared memory or inline)
    inline.py        a bucket's bytes inside its call (engines on another host)
    gloo_sender.py   the full-weight sync to several engines at once over one gloo / NCCL group
    cuda_ipc.py      a bucket handed over as a CUDA IPC handle (GPU engines on the trainer's GPU)
"""
