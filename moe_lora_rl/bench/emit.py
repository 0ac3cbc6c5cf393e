"""The one JSON line of a bench (or key: value lines without --json)."""
from __future__ import annotations

import json
import sys


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
