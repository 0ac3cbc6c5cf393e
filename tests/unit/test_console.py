"""The main job's console (rl/console.py): dependencies' noise (missing Apex/TE, deprecations inside dependencies)
goes to the log file only, our own and other warnings are shown too, and nothing is lost from the log."""
import io
import warnings

from moe_lora_rl.rl import console


def test_rules_by_source_module():
    site = "/venv/lib/python3.11/site-packages"
    assert console.module_of(f"{site}/megatron/core/models/backends.py") == "megatron.core.models.backends"
    assert console.module_of("/work/x/moe_lora_rl/megatron/cpu_support.py") == "moe_lora_rl.megatron.cpu_support"
    assert console.quiet(f"{site}/megatron/core/optimizer/__init__.py",
                         "Transformer Engine and Apex are not installed. Falling back", UserWarning)
    assert console.quiet(f"{site}/torch/utils/data.py", "x is deprecated", DeprecationWarning)
    # shown: a dependency's UserWarning that is not on the list, our own deprecation, a megatron warning of substance
    assert console.quiet(f"{site}/torch/utils/data.py", "x is deprecated", UserWarning) is None
    assert console.quiet("/work/x/moe_lora_rl/rl/run.py", "x is deprecated", DeprecationWarning) is None
    assert console.quiet(f"{site}/megatron/core/transformer/moe/router.py", "aux loss is NaN", UserWarning) is None


def test_router_shows_what_matters_and_logs_everything(tmp_path, monkeypatch):
    site = "/venv/lib/python3.11/site-packages"
    r = console._Router()
    err = io.StringIO()
    r.show(UserWarning("Apex is not installed. Falling back to Torch Norm"), UserWarning,
           f"{site}/megatron/core/models/backends.py", 21, file=err)
    r.show(UserWarning("the reward is constant"), UserWarning, "/w/moe_lora_rl/rl/run.py", 5, file=err)
    assert "Apex" not in err.getvalue() and "the reward is constant" in err.getvalue()
    assert r.held and len(r.held) == 2                        # held until the log file is known
    monkeypatch.setattr(console, "_router", r)
    path = console.log_warnings_to(tmp_path / "out" / "warnings-rank0.log")
    r.show(DeprecationWarning("old api"), DeprecationWarning, f"{site}/torch/x.py", 3, file=err)
    text = path.read_text()
    assert "Apex is not installed" in text and "the reward is constant" in text and "old api" in text
    assert "old api" not in err.getvalue() and (r.shown, r.logged) == (1, 3)


def test_route_warnings_is_called_not_imported():
    assert warnings.showwarning is not getattr(console._router, "show", None)   # importing changed nothing
