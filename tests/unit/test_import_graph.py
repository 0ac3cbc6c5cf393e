"""The package layout stays as designed: every import of moe_lora_rl's own modules (module level and inside functions,
read with `ast`, nothing imported) goes in an allowed direction, neither the packages nor any two modules form a
cycle, and the upstream libraries are imported only where the layout says (verl: the integration, the algorithms leaf
and the checks' verl harness; megatron-core: never by the vLLM plugin). Measuring code has rooms of its own: checks/
(the kit tests and benches share), bench/ (the entry modules), bench/workers/ (the processes the benches start) and
bench/runners/ (the peers' runners); no product package imports any of them, and nothing in the package imports the
test-only kit (tests/kit, imported as `kit`).

An import inside a function counts as an edge like one at the top of the file: it is deferred to keep start-up light,
not to hide a dependency, and a circle through it is still two modules that each need the other."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moe_lora_rl

ROOT = Path(moe_lora_rl.__file__).parent

# package -> the packages of ours it may import (besides itself). A package is a top-level module or folder of
# moe_lora_rl; integration/verl counts as "integration".
ALLOWED = {
    "procs": set(),
    "models": set(),
    "algos": set(),                                                # verl's pure functions, nothing of ours
    "mismatch": set(),                                             # log-prob mismatch statistics, torch only
    "plan": {"models"},                                            # models: the naming tables
    "transfer": {"models", "procs"},                               # wire, buckets, transports: no LoRA, no Megatron
    "megatron": {"models"},
    "lora": {"megatron", "models"},
    "router_replay": {"megatron", "models"},
    "refit": {"lora", "models", "transfer"},
    "vllm": {"models", "procs", "router_replay", "transfer"},      # transfer: the wire, segments, a peer's export
    "checkpoint": {"lora", "megatron", "models"},
    "policy": {"algos", "lora", "megatron", "models", "refit", "router_replay", "transfer"},
    "rollout": {"models", "procs", "router_replay", "transfer", "vllm"},
    "integration": {"algos", "checkpoint", "lora", "megatron", "mismatch", "models", "policy", "refit", "router_replay",
                    "vllm", "procs", "transfer"},
    "data": {"models"},                                            # task, rows, reward, warm start: below rl/
    "rl": {"algos", "checkpoint", "data", "lora", "megatron", "mismatch", "models", "policy", "refit", "rollout",
           "router_replay", "procs"},
    "train": {"rl"},
    "launch": {"data", "rl"},                                      # moe-lora-rl train: checks, then the ranks
    "cli": {"plan", "launch"},                                     # the moe-lora-rl console script
    "upstream": set(),                                             # the compatibility report: ast only
    "checks": {"algos", "integration", "lora", "megatron", "mismatch", "models", "policy", "procs", "refit", "rollout",
               "router_replay", "transfer", "vllm"},
    "bench.workers": {"checks", "data", "lora", "megatron", "models", "policy", "refit", "rollout", "transfer", "vllm"},
    "bench.runners": {"algos", "checkpoint", "checks", "data", "lora", "megatron", "models", "plan", "procs", "refit",
                      "rl", "rollout", "transfer"},      # the runs the benches start, read back, modelled and drawn
    "bench": {"bench.runners", "checks", "lora", "megatron", "mismatch", "models", "plan", "rl", "rollout",
              "transfer"},                                         # bench.workers: started by name, not imported
}
SUBPACKAGES = {"bench.workers", "bench.runners"}                 # rooms of their own inside a package
# third-party packages confined to some of ours: library -> packages (or single modules) allowed to import it
CONFINED = {
    "verl": {"integration", "algos", "checks.verl_worker", "checks.verl_refit", "checks.verl_compose",
             "checks.verl_async", "checks.verl_data", "checks.verl_adapter_path"},
}
FORBIDDEN = {"vllm": {"megatron"}, "lora": {"verl"}, "refit": {"verl"}, "router_replay": {"verl"},
             "transfer": {"megatron", "verl"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported module, line) for every import in the file, relative imports resolved."""
    mod = _module_name(path)
    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or target == "moe_lora_rl":    # `from . import x`: x may be a module
                for a in node.names:
                    yield f"{target}.{a.name}", node.lineno
            else:
                yield target, node.lineno


def _package(module: str) -> str:
    parts = module.split(".")
    if ".".join(parts[1:3]) in SUBPACKAGES:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def _edges():
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        for target, line in _imports(path):
            yield mod, target, f"{path.relative_to(ROOT.parent)}:{line}"


def _module_edges():
    """(module, module of ours it imports, where) with each target resolved to the deepest module that exists:
    `from .pkg import name` names the module pkg.name when there is one, else pkg itself. Only what an import names
    is an edge: the parent packages' __init__ that Python runs on the way are not (a package importing its own
    submodules would otherwise be a circle with each of them)."""
    modules = {_module_name(p) for p in ROOT.rglob("*.py")}

    def deepest(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            else:
                continue
            for t in targets:
                if t == "moe_lora_rl" or t.startswith("moe_lora_rl."):
                    t = deepest(t)
                    if t and t != mod:
                        yield mod, t, f"{path.relative_to(ROOT.parent)}:{node.lineno}"


def _module_cycle() -> list[str]:
    """One import circle between modules as [a, b, ..., a] with where each import is, or [] when there is none."""
    graph: dict[str, dict[str, str]] = {}
    for mod, target, where in _module_edges():
        graph.setdefault(mod, {}).setdefault(target, where)
    state: dict[str, int] = {}                  # 1: on the current path, 2: done (no circle through it)
    for start in sorted(graph):
        if start in state:
            continue
        path, its = [start], [iter(sorted(graph.get(start, {})))]
        state[start] = 1
        while path:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                loop = path[path.index(nxt):] + [nxt]
                return [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(loop, loop[1:])]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(sorted(graph.get(nxt, {}))))
    return []


def _fake_package(tmp_path, monkeypatch, files: dict):
    """A package moe_lora_rl under tmp_path holding `files` (relative path -> text), made the walked ROOT."""
    pkg = tmp_path / "moe_lora_rl"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    return pkg


def test_no_cycle_between_modules():
    cycle = _module_cycle()
    assert not cycle, "modules on an import circle:\n" + "\n".join(cycle)


def test_the_module_walk_finds_a_circle_through_a_function_level_import(tmp_path, monkeypatch):
    """Control: base imports nothing at the top but names derived inside a function, derived imports base."""
    pkg = _fake_package(tmp_path, monkeypatch, {"rl/__init__.py": "from . import base\n",
                                                "rl/base.py": "import json\n\ndef f():\n    from .derived import D\n",
                                                "rl/derived.py": "from .base import f\n"})
    cycle = _module_cycle()
    assert [c.split(" (")[0] for c in cycle] == ["moe_lora_rl.rl.base -> moe_lora_rl.rl.derived",
                                                 "moe_lora_rl.rl.derived -> moe_lora_rl.rl.base"], cycle
    (pkg / "rl" / "base.py").write_text("import json\n")
    assert _module_cycle() == []             # and a package importing its submodule is no circle


def test_every_package_is_in_the_table():
    found = {_package(_module_name(p)) for p in ROOT.rglob("*.py")} - {""}
    assert found == set(ALLOWED), f"packages not in ALLOWED: {found - set(ALLOWED)}; gone: {set(ALLOWED) - found}"


def test_imports_between_our_packages_go_the_allowed_way():
    bad = []
    for mod, target, where in _edges():
        if not target.startswith("moe_lora_rl.") or target == "moe_lora_rl":
            continue
        a, b = _package(mod), _package(target)
        if a and a != b and b not in ALLOWED[a]:
            bad.append(f"{where}: {a} -> {b} ({target})")
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    graph = {p: set() for p in ALLOWED}
    for mod, target, _ in _edges():
        if target.startswith("moe_lora_rl."):
            a, b = _package(mod), _package(target)
            if a and b and a != b:
                graph[a].add(b)
    # Tarjan-free check: a package that reaches itself through others is on a cycle
    cycles = []
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            n = stack.pop()
            if n == start:
                cycles.append(start)
                break
            if n not in seen:
                seen.add(n)
                stack.extend(graph.get(n, ()))
    assert not cycles, f"packages on an import cycle: {sorted(cycles)} (graph: {graph})"


def test_the_package_never_imports_the_test_kit():
    bad = [f"{where}: {target}" for _, target, where in _edges() if target.split(".")[0] in ("kit", "tests")]
    assert not bad, "the installed package imports the test-only kit (tests/kit):\n" + "\n".join(bad)


def test_measuring_code_is_imported_by_measuring_code_only():
    measuring = {"checks", "bench", *SUBPACKAGES}
    bad = [f"{where}: {target}" for mod, target, where in _edges() if target.startswith("moe_lora_rl.")
           and _package(target) in measuring and _package(mod) not in measuring]
    assert not bad, "product code imports checks/ or bench/:\n" + "\n".join(bad)


@pytest.mark.parametrize("library", sorted(CONFINED))
def test_upstream_library_confined(library):
    allowed = CONFINED[library]
    bad = []
    for mod, target, where in _edges():
        if target == library or target.startswith(library + "."):
            short = mod.removeprefix("moe_lora_rl.")
            if not any(short == a or short.startswith(a + ".") for a in allowed):
                bad.append(f"{where}: {mod} imports {target}")
    assert not bad, f"{library} imported outside {sorted(allowed)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_forbidden_upstream_imports(package):
    bad = [f"{where}: {target}" for mod, target, where in _edges() if _package(mod) == package
           and any(target == lib or target.startswith(lib + ".") for lib in FORBIDDEN[package])]
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_the_walker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """Control: a module of `lora` importing `rl` inside a function is found (the test can fail)."""
    _fake_package(tmp_path, monkeypatch, {"lora/__init__.py": "",
                                          "lora/x.py": "def f():\n    from ..rl import run\n    import verl\n"})
    edges = list(_edges())
    assert ("moe_lora_rl.lora.x", "moe_lora_rl.rl") in [(m, t) for m, t, _ in edges]
    assert ("moe_lora_rl.lora.x", "verl") in [(m, t) for m, t, _ in edges]


def test_the_walker_sees_a_worker_importing_a_bench_entry_or_the_kit(tmp_path, monkeypatch):
    """Control: a bench worker importing a bench entry module, and a package module importing the test kit, are
    edges the rules above refuse (bench.workers -> bench is not allowed; kit is outside the package)."""
    _fake_package(tmp_path, monkeypatch, {"bench/__init__.py": "", "bench/e2e.py": "",
                                          "bench/workers/__init__.py": "",
                                          "bench/workers/w.py": "from .. import e2e\nfrom kit import fakes\n"})
    edges = [(_package(m), t) for m, t, _ in _edges()]
    assert ("bench.workers", "moe_lora_rl.bench.e2e") in edges and "bench" not in ALLOWED["bench.workers"]
    assert ("bench.workers", "kit") in edges
