"""The Megatron run config on a bench command line (--device, --dtype): validated in the parent before any worker
or process group starts; a bad value is one line on stderr and exit code 2, no traceback."""
from __future__ import annotations

import argparse
import sys

from ..megatron.run_config import DEVICES, DTYPES, RunConfig


def add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cpu", help=f"one of {DEVICES}")
    ap.add_argument("--dtype", default="fp32", help=f"base-model dtype, one of {tuple(DTYPES)}")


def run_config_from_args(a: argparse.Namespace, prog: str) -> RunConfig:
    try:
        rc = RunConfig(device=a.device, dtype=a.dtype)
        rc.check_host()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    return rc

