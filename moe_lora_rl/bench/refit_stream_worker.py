"""torchrun worker: the streaming adapter gather against the all_gather_object gather, per rank and layout.

Per rank it measures the extra resident memory (VmHWM after the call minus VmRSS before it, from /proc, after
resetting the high-water mark through /proc/self/clear_refs) of: the old gather (lora.state.gather_adapters), the
streaming PEFT export at each bucket size, and the streaming per-sender path (each sender writes its own buckets).
It checks the streamed PEFT file and a streamed push (through the engine's own adapter validation) against the
full gather bit for bit. Rank 0 writes the JSON result."""
from __future__ import annotations

import argparse
import gc
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from ..lora import LoRAConfig, adapter_factors, gather_adapters
from ..lora.layers import make_factor
from ..lora.state import group_rank_size
from ..megatron.run_config import RunConfig, prepare_host
from ..policy.model import build_from_hf
from ..megatron.layout import Layout
from ..megatron.parallel import init_distributed, teardown
from ..refit.export import stream_to_peft
from ..refit.gather import build_plan, local_reports, stream
from ..refit.rename import to_peft_tensors
from ..refit.transports import _Base, push_stream
from ..refit.wire import checksum
from ..checks.launch import finish_worker


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class PeakMeter:
    """Extra resident bytes of this process over a block: VmHWM at the end minus VmRSS at the start."""

    def __enter__(self):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")            # VmHWM := VmRSS
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = _status("VmHWM") - self.start


class SpoolEngine(_Base):
    """Stands in for an engine's /collective_rpc endpoint that every sender reaches: buckets land as files in one
    folder (wire format: safetensors); the commit reads them all and validates through the engine's own check
    (vllm.adapter_set.build_adapter_set, with the checksum)."""

    def __init__(self, arch, folder: Path):
        self.arch, self.folder, self.begin, self.received = arch, folder, None, {}

    def _call(self, method, *args):
        from safetensors.torch import load_file

        from ..vllm.adapter_set import build_adapter_set

        if method == "moe_lora_begin":
            self.begin = args
            return {"staging": args[0]}
        version, digest = args
        _, _, rank, alpha, num_buckets = self.begin
        files = sorted(self.folder.glob(f"v{version}-*.safetensors"))
        if len(files) != num_buckets:
            raise ValueError(f"version {version}: {len(files)} of {num_buckets} buckets arrived")
        self.received = {k: v for f in files for k, v in load_file(str(f)).items()}
        a = build_adapter_set(self.received, self.arch, rank=rank, alpha=alpha, version=version,
                              expected_checksum=digest)
        return {"version": a.version, "checksum": a.checksum, "num_tensors": a.num_tensors}

    def _send_bucket(self, version, index, tensors):
        from safetensors.torch import save_file

        save_file(dict(tensors), str(self.folder / f"v{version}-{index:05d}.safetensors"))


def randomize(model, seed: int) -> None:
    """Every factor set from its global name (replicas agree), so the adapters are not the zero B of init."""
    with torch.no_grad():
        for _, p in adapter_factors(model):
            r, n = group_rank_size(p.lora_meta.group)
            p.copy_(make_factor(p.lora_meta, r, n, init="kaiming", seed=seed, dtype=p.dtype))


def run_one(path: str, key: str, cfg: LoRAConfig, buckets: list[int], work: Path) -> dict:
    me = dist.get_rank()
    arch, model = build_from_hf(path, Layout.parse(key), lora=cfg)
    randomize(model, seed=1)
    shard = sum(p.numel() * 4 for _, p in adapter_factors(model))
    rec: dict = {"shard_bytes": shard}
    with PeakMeter() as m:
        full = gather_adapters(model)
    rec["old_peak"] = m.peak
    ref = to_peft_tensors(full, arch)
    del full
    rec["full_bytes"] = sum(t.numel() * 4 for t in ref.values())
    rec["stream_peak"], rec["sender_peak"], rec["send_bytes"], rec["exact"] = {}, {}, {}, {}
    for k in buckets:
        out = work / f"peft-{key}-{k}"
        with PeakMeter() as m:
            digest = stream_to_peft(model, arch, out, bucket_bytes=k, writer_rank=0)
        rec["stream_peak"][k] = m.peak
        plan = build_plan(model, arch, k)
        rec["send_bytes"][k] = plan.send_bytes(me)
        spool = work / f"spool-{key}-{k}-{me}.bin"
        with PeakMeter() as m, open(spool, "wb") as f:
            stream(model, arch, plan, lambda b, buf: f.write(memoryview(buf.numpy())), collect_to=None)
        rec["sender_peak"][k] = m.peak
        spool.unlink()
        if me == 0:
            from safetensors.torch import load_file

            got = load_file(str(out / "adapter_model.safetensors"))
            rec["exact"][k] = sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
            rec["digest_ok"] = digest == checksum(ref)
    folder = work / f"engine-{key}-{Path(path).name}"
    folder.mkdir(exist_ok=True)
    engine = SpoolEngine(arch, folder)                          # every rank reaches the same engine
    res = push_stream(model, arch, engine, 7, cfg.rank, cfg.alpha, bucket_bytes=min(buckets), collect_to=None)
    if me == 0:
        got = engine.received
        rec["push_exact"] = sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
        rec["push_served"] = res.served
    with torch.no_grad():                       # negative control: one sent expert factor changed by 1 ulp
        _, params = local_reports(model)
        mine = [n for n, f in zip(params, local_reports(model)[0]) if f.sends and ".experts." in n]
        if mine:
            params[mine[0]].view(-1)[0] = torch.nextafter(params[mine[0]].view(-1)[0], torch.tensor(1e9))
    stream_to_peft(model, arch, work / f"peft-{key}-changed", bucket_bytes=min(buckets), writer_rank=0)
    if me == 0:
        from safetensors.torch import load_file

        got = load_file(str(work / f"peft-{key}-changed" / "adapter_model.safetensors"))
        rec["changed_exact"] = all(torch.equal(got[n], ref[n]) for n in ref)
    try:
        build_plan(model, arch, 1024)
        rec["small_bucket_error"] = "accepted"
    except ValueError as e:
        rec["small_bucket_error"] = str(e)
    del model
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--lora", required=True, help="LoRAConfig as JSON")
    ap.add_argument("--buckets", required=True, help="comma-separated bucket sizes in bytes")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    prepare_host(RunConfig())                                # fp32 on CPU: the caller applies the CPU support
    cfg = LoRAConfig.from_dict(json.loads(a.lora))
    buckets = [int(b) for b in a.buckets.split(",")]
    summary: dict = {}
    d = Path(a.result).parent / "refit-stream"                # one folder for every rank, next to the result
    d.mkdir(exist_ok=True)
    for key in a.layouts.split(","):
        layout = Layout.parse(key)
        init_distributed(layout)
        for path in a.models.split(","):
            rec = run_one(path, key, cfg, buckets, Path(d))
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, rec)
            summary.setdefault(key, {})[path] = per_rank
        teardown()
    dist.barrier()
    finish_worker(summary, a.result)


if __name__ == "__main__":
    main()
