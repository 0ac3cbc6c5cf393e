"""LoRA-only refit from Megatron to rollout engines, the whole pipeline in this package:

    gather TP/ETP -> collect EP/PP -> rename to PEFT -> bucket -> checksum -> send -> engine validates and commits

    stream_plan.py  pure: owner map and buckets (one sender each, within bucket_bytes), checked against the config
    gather.py       executes it: each bucket assembled on the rank that sends it (point-to-point within TP/ETP)
    rename.py       pure: canonical factors -> PEFT tensors, shard by shard (names from models/naming)
    wire.py         pure: checksum, blob and buffer encodings (also imported by the vLLM plugin)
    export.py       PEFT adapter directory, whole or streamed bucket by bucket
    transports.py   movers: in-process engine, HTTP server, merged full-weight reload; push_stream
    plan.py         bucket plan of an already gathered adapter (single-process pushes)
    merged.py, server.py, calc.py   full-weight refit, server launcher, sizes by calculation
"""
