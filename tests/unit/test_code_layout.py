"""docs/code_layout.md is drawn from the tree: every package and module at the top of moe_lora_rl/ and every bench key
has its line there, and a line that names nothing in the tree is stale."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "code_layout.md"


def tree_entries(pkg: Path) -> set[str]:
    """moe_lora_rl/<package>/ for each package directory, moe_lora_rl/<module>.py for each top-level module."""
    out = {f"moe_lora_rl/{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").is_file()}
    return out | {f"moe_lora_rl/{f.name}" for f in pkg.glob("*.py") if f.name != "__init__.py"}


def missing_and_stale(page: str, entries: set[str], benches: set[str]) -> tuple[list[str], list[str]]:
    named = set(re.findall(r"^(moe_lora_rl/[\w/]+?(?:/|\.py))", page, re.M))
    named_top = {n if n.endswith(".py") else "/".join(n.split("/")[:2]) + "/" for n in named}
    bench = re.search(r"^moe_lora_rl/bench/\s+python -m moe_lora_rl\.bench NAME --json \(([^)]*)\)", page, re.M | re.S)
    keys = set(re.split(r"[,\s]+", bench.group(1).strip())) if bench else set()
    missing = sorted(entries - named_top) + sorted(f"bench key {k}" for k in benches - keys)
    stale = sorted(named_top - entries) + sorted(f"bench key {k}" for k in keys - benches)
    return missing, stale


def test_every_package_module_and_bench_key_has_its_line():
    from moe_lora_rl.bench.__main__ import BENCHES

    missing, stale = missing_and_stale(PAGE.read_text(), tree_entries(ROOT / "moe_lora_rl"), set(BENCHES))
    assert not missing, f"docs/code_layout.md lacks: {missing}"
    assert not stale, f"docs/code_layout.md names what the tree does not have: {stale}"


def test_the_check_names_a_removed_line_and_a_stale_one():
    """The control: the page without its transfer/ line, with a package that does not exist, and a bench key gone."""
    page = PAGE.read_text()
    entries = tree_entries(ROOT / "moe_lora_rl")
    cut = "\n".join(l for l in page.splitlines() if not l.startswith("moe_lora_rl/transfer/"))
    assert missing_and_stale(cut, entries, set())[0][:1] == ["moe_lora_rl/transfer/"]
    extra = page.replace("```\nmoe_lora_rl/models/", "```\nmoe_lora_rl/weight_sync/  gone\nmoe_lora_rl/models/", 1)
    assert "moe_lora_rl/weight_sync/" in missing_and_stale(extra, entries, set())[1]
    from moe_lora_rl.bench.__main__ import BENCHES

    assert "bench key nope" in missing_and_stale(page, entries, set(BENCHES) | {"nope"})[0]
