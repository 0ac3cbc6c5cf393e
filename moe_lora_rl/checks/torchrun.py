"""Start a worker module under torchrun (gloo, CPU) and return what its rank 0 reported as JSON; and the worker's
side of that protocol, the preamble every torchrun worker shares:

    a = worker_args(argv, add)          its own arguments, --run-config (the parent's RunConfig as JSON), --result
    for key, layout, mi, path in each_model_at_layout(a):   process groups per layout, torn down after each
        ...
    finish_worker(result, a.result)     rank 0 writes the JSON; every rank leaves the process group together

run_torchrun_jobs starts several workers' mains in one launch (jobs_worker.py): the ranks import and meet once.

Environment set for every rank: OMP_NUM_THREADS=1 (2 cores, up to 4 ranks), TORCH_COMPILE_DISABLE=1 (megatron's
jit_fuser is torch.compile, which costs 10-30 s per first call on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ..megatron.layout import Layout
from ..megatron.run_config import RunConfig
from ..procs import free_port


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


def run_process(module: str, args: list[str], timeout: float = 1200, cwd=None, what: str | None = None) -> dict:
    """`python -m module args` in one process (an in-process engine); its last stdout line "RESULT <json>"."""
    proc = subprocess.run([sys.executable, "-m", module, *args], env=worker_env(), cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what or module} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_torchrun_jobs(nproc: int, jobs: list[tuple[str, list[str]]], timeout: float = 900) -> list[dict]:
    """Several workers (module, its arguments) in one torchrun launch, in turn in the same ranks and process group
    (jobs_worker.py): what each one's rank 0 reported, as run_torchrun would return it for that worker alone.
    timeout: per job. One job is launched alone."""
    if len(jobs) == 1:
        module, args = jobs[0]
        return [run_torchrun(module, nproc, args, timeout)]
    with tempfile.TemporaryDirectory() as d:
        spec = [[module, [*args, "--result", str(Path(d) / f"job{i}.json")]] for i, (module, args) in enumerate(jobs)]
        run_torchrun("moe_lora_rl.checks.jobs_worker", nproc, ["--jobs", json.dumps(spec)], timeout * len(jobs))
        return [json.loads((Path(d) / f"job{i}.json").read_text()) for i in range(len(jobs))]


KEEP_GROUP = False          # set by jobs_worker while another job follows in this process group (finish_worker keeps it)


def finish_worker(result: dict, path: str) -> None:
    """Rank 0 writes the worker's JSON result; every rank then leaves the process group together (unless another
    job of run_torchrun_jobs follows)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    dist.barrier()
    if not KEEP_GROUP:
        dist.destroy_process_group()


def worker_arg(rc: RunConfig) -> list[str]:
    """The parent's RunConfig on a worker's command line (read back by worker_args as a.rc)."""
    return ["--run-config", json.dumps(rc.to_dict())]


def worker_args(argv=None, add: Callable[[argparse.ArgumentParser], None] | None = None,
                models_at_layouts: bool = False, lora: bool = False) -> argparse.Namespace:
    """A torchrun worker's command line: its own arguments (add); with models_at_layouts --models and --layouts
    (comma-separated: every model at every layout, each_model_at_layout); with lora --lora (a LoRAConfig as JSON,
    parsed into a.lora); --run-config (worker_arg; default fp32 on CPU) and --result (the JSON file rank 0
    writes). The host is prepared for the run config (a.rc) before any process group or model exists."""
    from ..megatron.run_config import prepare_host

    ap = argparse.ArgumentParser()
    if models_at_layouts:
        ap.add_argument("--models", required=True, help="comma-separated HF checkpoint dirs")
        ap.add_argument("--layouts", required=True, help="comma-separated layouts, e.g. tp2ep2,pp2ep2")
    if lora:
        ap.add_argument("--lora", required=True, help="LoRAConfig as JSON")
    if add is not None:
        add(ap)
    ap.add_argument("--run-config", default="", help="RunConfig as JSON (worker_arg); default fp32 on CPU")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    a.rc = RunConfig.from_dict(json.loads(a.run_config)) if a.run_config else RunConfig()
    if lora:
        from ..lora import LoRAConfig

        a.lora = LoRAConfig.from_dict(json.loads(a.lora))
    prepare_host(a.rc)
    return a


def each_layout(names: str, rc: RunConfig | None = None) -> Iterator[tuple[str, Layout]]:
    """Process groups for each comma-separated layout in turn (one launch checks many layouts)."""
    from ..megatron.parallel import init_distributed, teardown

    for key in names.split(","):
        layout = Layout.parse(key)
        init_distributed(layout, rc)
        yield key, layout
        teardown()


def each_model_at_layout(a: argparse.Namespace) -> Iterator[tuple[str, Layout, int, str]]:
    """(layout name, layout, model index, model dir): every --models entry at every --layouts entry, layout-major."""
    for key, layout in each_layout(a.layouts, a.rc):
        for mi, path in enumerate(a.models.split(",")):
            yield key, layout, mi, path
