"""torchrun worker: the streaming adapter gather against the all_gather_object gather, per rank and layout.

Per rank it measures the extra resident memory (VmHWM after the call minus VmRSS before it, from /proc, after
resetting the high-water mark through /proc/self/clear_refs) of: the old gather (lora.state.gather_adapters), the
streaming PEFT export at each bucket size, and the streaming per-sender path (each sender writes its own buckets).
It checks the streamed PEFT file and a streamed push (through the engine's own adapter validation) against the
full gather bit for bit. Rank 0 writes the JSON result."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lora_rl.lora import LoRAConfig, adapter_factors, gather_adapters
from moe_lora_rl.megatron.layout import Layout
from moe_lora_rl.policy.model import build_from_hf
from moe_lora_rl.refit.export import stream_to_peft
from moe_lora_rl.refit.gather import build_plan, local_reports, prepare, stream
from moe_lora_rl.refit.push import push_stream
from moe_lora_rl.refit.rename import to_peft_tensors
from moe_lora_rl.transfer.wire import checksum
from moe_lora_rl.checks.adapters import randomize_adapters
from .fakes import FakeEngine
from moe_lora_rl.checks.torchrun import each_model_at_layout, finish_worker, worker_args


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


def run_one(path: str, key: str, cfg: LoRAConfig, buckets: list[int], work: Path) -> dict:
    me = dist.get_rank()
    arch, model = build_from_hf(path, Layout.parse(key), lora=cfg)
    randomize_adapters(model, seed=1)
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
    engine = FakeEngine(arch, folder=folder)                    # every rank reaches the same engine
    kept = prepare(model, arch, min(buckets))                   # planned once, reused after the values change
    res = push_stream(model, arch, engine, 7, cfg.rank, cfg.alpha, bucket_bytes=min(buckets), collect_to=None,
                      prepared=kept)
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
    push_stream(model, arch, engine, 8, cfg.rank, cfg.alpha, bucket_bytes=min(buckets), collect_to=None,
                prepared=kept)                                  # the stream planned before the change
    if me == 0:
        rec["kept_plan_push_exact"] = all(torch.equal(engine.received[n], got[n]) for n in got)
    try:
        build_plan(model, arch, 1024)
        rec["small_bucket_error"] = "accepted"
    except ValueError as e:
        rec["small_bucket_error"] = str(e)
    del model
    return rec


def main(argv=None):
    a = worker_args(argv, lambda ap: ap.add_argument("--buckets", required=True, help="bucket sizes in bytes, "
                                                     "comma-separated"), models_at_layouts=True, lora=True)   # fp32
    buckets = [int(b) for b in a.buckets.split(",")]
    summary: dict = {}
    d = Path(a.result).parent / "refit-stream"                # one folder for every rank, next to the result
    d.mkdir(exist_ok=True)
    for key, _, _, path in each_model_at_layout(a):
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, run_one(path, key, a.lora, buckets, d))
        summary.setdefault(key, {})[path] = per_rank
    dist.barrier()
    finish_worker(summary, a.result)

if __name__ == "__main__":
    main()
