"""Look up upstream symbols in a package's source without importing it (pure: ast and zipfile only).

    PackageSource(path)            a wheel (read as a zip, only the modules asked for) or a site-packages folder
    lookup(source, symbol)         one symbol's state in one source: `Found(state, signature)`
    report(symbols, sources)       {symbol: {label: Found}}; a signature differing from the baseline's is "changed"

A symbol is (module, qualname, params): qualname "" is the module itself, "Name" a module-level name (a def, class,
assignment, import, `__all__` entry, lazy `__getattr__` key, or submodule), "Class.member" a class member (method,
property, class attribute, or `self.member = ...` in any method), searched through the class's bases where they
resolve inside the same package (torch.nn.Module and the like do not: a member only they hold reads "missing").
params: parameter names the member must accept (keywords we pass, arguments our override takes).
"""
from __future__ import annotations

import ast
import functools
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

PRESENT, CHANGED, MISSING, NO_MODULE, BAD_PARAMS = "present", "changed", "missing", "no module", "missing params"


@dataclass(frozen=True)
class Symbol:
    module: str                          # dotted module path, e.g. "vllm.v1.worker.gpu_model_runner"
    qualname: str = ""                   # "" | "Name" | "Class.member"
    params: tuple[str, ...] = ()         # parameter names the callable must accept
    why: str = ""                        # what we do with it (import, subclass override, hook, keyword passed)
    where: str = ""                      # our file that uses it

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    @property
    def label(self) -> str:
        return self.module + (f":{self.qualname}" if self.qualname else "")


@dataclass(frozen=True)
class Found:
    state: str                           # PRESENT | CHANGED | MISSING | NO_MODULE | BAD_PARAMS
    signature: str | None = None         # "(self, layer, w13, w2)" for a function, None otherwise
    detail: str = ""


class PackageSource:
    """The .py files of a wheel or of a folder holding top-level packages (site-packages)."""

    def __init__(self, path: str | Path, label: str | None = None):
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"{self.path}: no such wheel or folder")
        self.label = label or self.path.name
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._trees: dict[str, ast.Module | None] = {}

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", "replace") if rel in self._names else None
        p = self.path / rel
        return p.read_text("utf-8", "replace") if p.is_file() else None

    def is_package(self, module: str) -> bool:
        rel = module.replace(".", "/") + "/__init__.py"
        return (rel in self._names) if self._zip is not None else (self.path / rel).is_file()

    def tree(self, module: str) -> ast.Module | None:
        """The parsed module (its .py file, or its package's __init__.py); None when it is not there."""
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Parameter names and markers only (no annotations or defaults): "(self, x, *args, key, **kw)"."""
    a = fn.args
    parts = [p.arg for p in a.posonlyargs] + (["/"] if a.posonlyargs else []) + [p.arg for p in a.args]
    if a.vararg:
        parts.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        parts.append("*")
    parts += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        parts.append("**" + a.kwarg.arg)
    return "(" + ", ".join(parts) + ")"


def _accepts(fn, name: str) -> bool:
    a = fn.args
    return bool(a.kwarg) or name in {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}


def _absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_pkg else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


def _module_level(body):
    """Statements run at module level: the body, and the bodies of its if / try / with blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, part, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _top_binding(src: PackageSource, module: str, name: str, seen: frozenset = frozenset()):
    """What binds `name` at module level: ("def", node) | ("import", (module, name)) | ("other", None) | None."""
    tree = src.tree(module)
    if tree is None or module in seen:
        return None
    lazy, stars = False, []
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return "def", node
            lazy |= node.name == "__getattr__"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return "other", None
        elif isinstance(node, ast.ImportFrom):
            for al in node.names:
                if al.name == "*":
                    stars.append(_absolute(module, node, src.is_package(module)))
                elif (al.asname or al.name) == name:
                    return "import", (_absolute(module, node, src.is_package(module)), al.name)
        elif isinstance(node, ast.Import):
            if any((al.asname or al.name.split(".")[0]) == name for al in node.names):
                return "other", None
    for star in stars:                                                # `from .x import *` (inside the package)
        if star.split(".")[0] == module.split(".")[0] and _top_binding(src, star, name, seen | {module}):
            return "import", (star, name)
    if src.tree(f"{module}.{name}") is not None:
        return "other", None                                          # a submodule
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    if lazy and name in strings:
        return "other", None                                          # a lazy attribute (module __getattr__)
    return None


def resolve(src: PackageSource, module: str, name: str, depth: int = 0):
    """(module, ClassDef/FunctionDef node | None) where `name` of `module` is defined, following re-exports inside
    the package; None when the name is not there."""
    found = _top_binding(src, module, name)
    if found is None:
        return None
    kind, what = found
    if kind == "import" and depth < 8:
        target_mod, target_name = what
        if src.tree(target_mod) is not None:
            return resolve(src, target_mod, target_name, depth + 1)
        if src.tree(f"{target_mod}.{target_name}") is not None:
            return f"{target_mod}.{target_name}", None
        return (module, None) if target_mod.split(".")[0] != module.split(".")[0] else None
    return module, (what if kind == "def" else None)


def _member_in_class(cls: ast.ClassDef, member: str):
    """The method node, True for any other binding, None when the class body does not bind it."""
    hit = None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == member:
            hit = node                                                # the last definition wins (property setters)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and hit is None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == member for t in targets):
                hit = True
    if hit is not None:
        if isinstance(hit, ast.AST) and any(isinstance(d, ast.Name) and d.id in ("property", "cached_property")
                                            or isinstance(d, ast.Attribute) and d.attr == "setter"
                                            for d in hit.decorator_list):
            return True
        return hit
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == member and isinstance(t.value, ast.Name) \
                    and t.value.id == "self":
                return True
    return None


def _base_names(cls: ast.ClassDef) -> list[str]:
    out = []
    for b in cls.bases:
        b = b.value if isinstance(b, ast.Subscript) else b
        if isinstance(b, ast.Name):
            out.append(b.id)
        elif isinstance(b, ast.Attribute):
            out.append(ast.unparse(b))
    return out


def find_member(src: PackageSource, module: str, cls: ast.ClassDef, member: str, depth: int = 0):
    """The member's node (or True) in `cls` or its bases that resolve inside the package; None if not found."""
    hit = _member_in_class(cls, member)
    if hit is not None or depth > 12:
        return hit
    for base in _base_names(cls):
        head, _, rest = base.partition(".")
        where = resolve(src, module, head)
        if where is None:
            continue
        bmod, node = where
        if rest and node is None:                                     # module.Class
            where = resolve(src, bmod, rest)
            bmod, node = where if where else (bmod, None)
        if isinstance(node, ast.ClassDef):
            hit = find_member(src, bmod, node, member, depth + 1)
            if hit is not None:
                return hit
    return None


@functools.lru_cache(maxsize=None)
def _cached(src: PackageSource, sym: Symbol) -> Found:
    return _lookup(src, sym)


def lookup(src: PackageSource, sym: Symbol) -> Found:
    """The symbol's state in `src` (PRESENT, MISSING, NO_MODULE or BAD_PARAMS; CHANGED is report()'s)."""
    return _cached(src, sym)


def _lookup(src: PackageSource, sym: Symbol) -> Found:
    if src.tree(sym.module) is None:
        return Found(NO_MODULE)
    if not sym.qualname:
        return Found(PRESENT)
    head, _, member = sym.qualname.partition(".")
    where = resolve(src, sym.module, head)
    if where is None:
        return Found(MISSING)
    mod, node = where
    if member:
        if not isinstance(node, ast.ClassDef):
            return Found(MISSING, detail=f"{head} is not a class here")
        node = find_member(src, mod, node, member)
        if node is None:
            return Found(MISSING)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if sym.params and isinstance(node, ast.ClassDef):
            init = find_member(src, mod, node, "__init__")
            node = init if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)) else node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found(PRESENT)
    sig = signature(node)
    lacking = [p for p in sym.params if not _accepts(node, p)]
    if lacking:
        return Found(BAD_PARAMS, sig, "lacks " + ", ".join(lacking))
    return Found(PRESENT, sig)


@dataclass
class Report:
    labels: list[str]
    rows: dict[Symbol, dict[str, Found]] = field(default_factory=dict)

    def bad(self, label: str) -> list[Symbol]:
        return [s for s, per in self.rows.items() if per[label].state != PRESENT]


def report(symbols, sources: list[PackageSource], baseline: PackageSource) -> Report:
    """Every symbol in every source; a present callable whose signature differs from the baseline's is CHANGED."""
    rep = Report([s.label for s in sources])
    base = {s: lookup(baseline, s) for s in symbols}
    for sym in symbols:
        per = {}
        for src in sources:
            got = lookup(src, sym)
            ref = base[sym]
            if got.state == PRESENT and ref.signature and got.signature and got.signature != ref.signature:
                got = Found(CHANGED, got.signature, f"was {ref.signature}")
            per[src.label] = got
        rep.rows[sym] = per
    return rep


def cell(found: Found) -> str:
    if found.state == PRESENT:
        return "ok"
    if found.state == CHANGED:
        return f"changed: `{found.signature}`"
    if found.state == BAD_PARAMS:
        return f"{found.detail}: `{found.signature}`"
    return found.state


def markdown(rep: Report, only_bad: bool = False) -> str:
    """One row per symbol, one column per source; only_bad: the rows where some source differs."""
    lines = ["| symbol | use | " + " | ".join(rep.labels) + " |", "|---|---|" + "---|" * len(rep.labels)]
    for sym, per in rep.rows.items():
        if only_bad and all(f.state == PRESENT for f in per.values()):
            continue
        lines.append(f"| `{sym.label}` | {sym.why}{f' ({sym.where})' if sym.where else ''} | " + " | ".join(cell(per[l]) for l in rep.labels) + " |")
    return "\n".join(lines)
