"""Start a worker module under torchrun (gloo, CPU) and return what its rank 0 reported as JSON.

The worker receives `--result PATH` and must write its JSON there from rank 0. Environment set for every rank:
OMP_NUM_THREADS=1 (2 cores, up to 4 ranks), TORCH_COMPILE_DISABLE=1 (megatron's jit_fuser is torch.compile, which
costs 10-30 s per first call on CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..megatron.parallel import free_port  # noqa: F401  (testing depends on megatron, never the reverse)


def worker_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def run_torchrun(module: str, nproc: int, args: list[str], timeout: float = 900) -> dict:
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", module, *args,
               "--result", str(result)]
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not result.exists():
            lines = (proc.stdout + proc.stderr).splitlines()
            first = next((i for i, l in enumerate(lines) if "Traceback" in l), max(0, len(lines) - 60))
            tail = "\n".join(l for l in lines[first:first + 80] if "warn" not in l.lower())
            raise RuntimeError(f"torchrun {module} (nproc={nproc}) failed with code {proc.returncode}:\n{tail}")
        return json.loads(result.read_text())


def finish_worker(result: dict, path: str) -> None:
    """Rank 0 writes the worker's JSON result; every rank then leaves the process group together."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
