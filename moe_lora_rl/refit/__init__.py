"""LoRA-only refit from Megatron to rollout engines: the adapter-specific part of the pipeline (the bytes travel
through transfer/'s transports):

    gather TP/ETP -> collect EP/PP -> rename to PEFT -> bucket -> checksum -> send -> engine validates and commits

    stream_plan.py  pure: owner map and buckets (one sender each, within bucket_bytes), checked against the config
    gather.py       executes it: each bucket assembled on the rank that sends it (point-to-point within TP/ETP)
    push.py         push_stream: the gathered buckets through a Transport (transfer/interface.py), one commit
    rename.py       pure: canonical factors -> PEFT tensors, shard by shard (names from models/naming)
    export.py       PEFT adapter directory, whole or streamed bucket by bucket
    peft_dir.py, import_peft.py   a PEFT adapter directory read back and loaded into a sharded model
    merged.py       the adapter merged into the base weights: merged checkpoints, the merged full-weight refit
"""
