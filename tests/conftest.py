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


# -- shared torchrun launches (CI time) ----------------------------------------------------------------------------
# A test module may declare LAUNCH = {name: {"nproc": N, "module": worker, "args": f(workdir) -> argv, "param": P}}
# and read its worker's result with shared_launch(name) -> (result, workdir). Every job of the same world size that
# the selected tests need (a test of its module selected, not skipped by a mark, and, with "param", parametrized
# with P) runs in one launch (checks/jobs_worker.py): the ranks import torch, megatron-core and verl and meet once.
# Running one file alone launches that file's jobs alone.
_LAUNCH_JOBS = pytest.StashKey[dict]()
_LAUNCH_WANTED = pytest.StashKey[list]()


def _skipped(item) -> bool:
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True) for m in item.iter_markers())


def pytest_collection_finish(session):
    jobs, wanted = {}, []
    for item in session.items:
        for name, job in (getattr(item.module, "LAUNCH", None) or {}).items():
            assert jobs.setdefault(name, job) is job, f"two test modules declare the launch job {name!r}"
            params = getattr(item, "callspec", None)
            if name not in wanted and not _skipped(item) and (
                    job.get("param") is None or (params and job["param"] in params.params.values())):
                wanted.append(name)
    session.config.stash[_LAUNCH_JOBS], session.config.stash[_LAUNCH_WANTED] = jobs, wanted


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory):
    """shared_launch(name) -> (the job's result as run_torchrun returns it, its workdir); the first call of a world
    size runs every wanted job of that size in one launch (a failed launch fails each of its jobs' tests)."""
    from moe_lora_rl.checks.launch import run_torchrun_jobs

    jobs, wanted = request.config.stash[_LAUNCH_JOBS], request.config.stash[_LAUNCH_WANTED]
    done: dict = {}

    def get(name: str):
        if name not in done:
            nproc = jobs[name]["nproc"]
            names = [n for n in wanted if jobs[n]["nproc"] == nproc and n not in done]
            names = names if name in names else [name]
            dirs = {n: tmp_path_factory.mktemp(n) for n in names}
            try:
                got = run_torchrun_jobs(nproc, [(jobs[n]["module"], jobs[n]["args"](dirs[n])) for n in names],
                                        timeout=sum(jobs[n].get("timeout", 900) for n in names))
                done.update({n: (r, dirs[n]) for n, r in zip(names, got)})
            except Exception as e:  # noqa: BLE001 - re-raised for each job of the launch
                done.update({n: e for n in names})
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]
    return get
