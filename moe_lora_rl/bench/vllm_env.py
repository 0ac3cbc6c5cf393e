"""Environment of a process that runs an in-process vLLM CPU engine. Set by the worker's main(), never at import
time: importing a worker module (tests import helpers from them) must not change the importing process."""
from __future__ import annotations

import os


def set_engine_env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # the engine core in this process: collective_rpc by reference
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB; the default is sized for real models
    os.environ["HF_HUB_OFFLINE"] = "1"                    # local checkpoints only
