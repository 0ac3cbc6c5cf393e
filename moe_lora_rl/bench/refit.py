"""refit: LoRA-only vs full merged-weight refit into vLLM, side by side on one engine; or the analytic calculator.

    python -m moe_lora_rl.bench refit --json [--model DIR] [--layouts tp1ep1pp1,ep4] [--rank 16]
    python -m moe_lora_rl.bench refit --calc --model kimi-k2 --json [--link-gbps 25] [--ranks 8,32,128]
        [--layouts tp8pp8ep32] [--bucket-bytes 2147483648]

Measured mode: Megatron trains LoRA one step at each given layout (default the medium qwen3_moe), the adapters go
to an in-process vLLM CPU engine (fp32) through InprocTransport; then the same engine reloads all weights with the
adapters merged (reload_weights). Times are medians of 3; logprob diffs are against Megatron+LoRA. Then the
cross-process pushes to a vLLM server on this host (bench/runners/refit_transports.py: memcpy_s, shm_push_s,
http_push_s); --transports-only measures just those.

Calc mode adds "streaming": the busiest rank of the streaming gather (refit/gather.py) for per_expert adapters at
the largest --ranks value, at --layouts (default: Kimi-K2's public training layout, Miles' TP8 PP8 CP4 EP32) with
--bucket-bytes (default: that recipe's 2 GiB update buffer), next to the all_gather_object gather's per-rank bytes.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..checks import lora_layouts
from ..checks.torchrun import run_process
from ..lora import LoRAConfig
from .emit import emit


def measured(model: str, layouts: list[str], cfg: LoRAConfig) -> dict:
    """Adapters trained at every layout (one LoRA run), each pushed to a fresh engine; the first layout's numbers
    on top, every layout's under per_layout."""
    per: dict = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        lora_layouts.run([model], ",".join(layouts), cfg, work, steps=1, lr=1e-3)
        for layout in layouts:
            per[layout] = run_process("moe_lora_rl.bench.workers.refit_vllm_worker",
                                      ["--model", model, "--blob", str(work / f"{layout}-m0.pt"), "--data",
                                       str(work / "data.pt"), "--rank", str(cfg.rank), "--alpha", str(cfg.alpha)],
                                      timeout=2400, cwd=work, what="refit bench worker")
    res = dict(per[layouts[0]])
    res.update({"megatron_layout": layouts[0], "rank": cfg.rank, "layouts": layouts})
    if len(layouts) > 1:
        res["per_layout"] = per
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench refit", description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--calc", action="store_true", help="analytic sizes instead of a measurement")
    ap.add_argument("--model", default=None, help="HF checkpoint dir, or with --calc a spec name (kimi-k2, ...)")
    ap.add_argument("--layouts", default=None, help="Megatron layout the adapters are trained at (measured: "
                    "default tp1ep1pp1; --calc: the streaming layout, default tp8pp8ep32)")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="--calc: streaming bucket size (default 2 GiB)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--ranks", default="8,32,128")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="link bandwidth, GB/s")
    ap.add_argument("--bytes-per-param", type=int, default=2)
    ap.add_argument("--transports-only", action="store_true",
                    help="only the cross-process push timings (no Megatron training)")
    a = ap.parse_args(argv)
    if a.calc and a.transports_only:
        raise ValueError("--calc and --transports-only exclude each other")
    if a.calc:
        from ..plan.refit_calc import KIMI_K2_BUCKET, KIMI_K2_LAYOUT, SPECS, refit_report, streaming_report

        name = a.model or "kimi-k2"
        if name not in SPECS:
            raise ValueError(f"--calc --model {name!r}: known specs {sorted(SPECS)}")
        ranks = tuple(int(r) for r in a.ranks.split(","))
        result = refit_report(SPECS[name], ranks=ranks, bytes_per_param=a.bytes_per_param, link_gbps=a.link_gbps)
        result["streaming"] = streaming_report(SPECS[name], max(ranks), a.layouts or KIMI_K2_LAYOUT,
                                               a.bucket_bytes or KIMI_K2_BUCKET, a.bytes_per_param)
    else:
        from ..models import get_model
        from ..checks.layouts import check_layouts
        from .runners.refit_transports import transport_timings

        if a.bucket_bytes is not None:
            raise ValueError("--bucket-bytes applies to --calc only")
        model = a.model or str(get_model("qwen3_moe", "medium"))
        layouts = [l.strip() for l in (a.layouts or "tp1ep1pp1").split(",") if l.strip()]
        check_layouts([model], ",".join(layouts))           # every layout is run: refuse bad ones up front
        result = {} if a.transports_only else measured(model, layouts, LoRAConfig(rank=a.rank, alpha=a.alpha))
        result.update(transport_timings(model, a.rank))
    emit(result, a.json)
    return result
