"""parity: Megatron at each layout vs HF transformers (fp32 logits).

    python -m moe_lora_rl.bench parity --json [--model DIR ...] [--layouts tp2ep2,pp2ep2] [--dtype bf16]

fp32: max |logit diff|, target 1e-4 (fp32 reduction orders; a wrong shard gives differences of order 1).
bf16: the median over tokens of each token's max |logit diff|, relative to max |fp32 logit|, target 8u with
u = 2^-8 (bf16's unit roundoff): every matmul output, residual add and norm rounds to 8 significant bits, so a
logit of magnitude |z| carries a few u*|z| of error (measured 2-4u). The median leaves out the few tokens whose
top-k routing flips under bf16 rounding (measured 0.5-1% of router decisions); those move a token's logits by O(1),
exactly as in HF transformers' own bf16 forward.
"""
from __future__ import annotations

import argparse
import time

from ..checks import parity_run as parity
from ..checks.layouts import DEFAULT_LAYOUTS, resolve_models
from .emit import emit
from .run_args import add_run_args, run_config_from_args


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench parity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--model", action="append", help="HF checkpoint directory (repeatable); default: tiny models")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated layouts, e.g. tp2ep2,pp2ep2")
    add_run_args(ap)
    a = ap.parse_args(argv)
    rc = run_config_from_args(a, ap.prog)
    t0 = time.time()
    result = parity.run(resolve_models(a.model), a.layouts, rc)
    result["wall_s"] = round(time.time() - t0, 1)
    emit(result, a.json)
    return result
