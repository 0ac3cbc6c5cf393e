import os

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def lora_trained(tmp_path_factory):
    """Expert LoRA (rank 4, alpha 8) trained 3 steps at every default layout, both models, once per session:
    tests/distributed/test_lora_layouts.py compares the layouts, tests/e2e/test_refit_vllm.py pushes the adapters
    trained at tp2ep2 and pp2ep2 to vLLM. Returns (models, report, workdir: blobs LAYOUT-mI.pt and data.pt, the LoRAConfig)."""
    from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS, resolve_models
    from moe_lora_rl.checks.lora_layouts import run
    from moe_lora_rl.lora import LoRAConfig

    work = tmp_path_factory.mktemp("lora")
    models, cfg = resolve_models(None), LoRAConfig(rank=4, alpha=8.0)
    return models, run(models, DEFAULT_LAYOUTS, cfg, work), work, cfg


@pytest.fixture
def train_cli(monkeypatch, capsys):
    """The train CLI's main in this process, for refusals that come before any process group or engine starts:
    returns (exit code, stderr lines). The console's warning routing it installs is undone after the test."""
    import warnings

    from moe_lora_rl.rl import console

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(console, "_router", None)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")

    def run(*args):
        from moe_lora_rl.train import main

        rc = main(list(args))
        err = capsys.readouterr().err
        return rc, [line for line in err.splitlines() if line.strip()], err
    return run
