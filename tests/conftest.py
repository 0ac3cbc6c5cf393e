import os
import sys
from pathlib import Path

# The test kit (tests/kit: test-only oracles, drivers and workers, outside the installed package) is imported as
# `kit`, here and in every process a test starts (torchrun workers, engines, `python -m kit.X`): tests/ and the
# checkout's root go first on sys.path and PYTHONPATH.
TESTS = Path(__file__).resolve().parent
for _p in (str(TESTS.parent), str(TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent),
                                            *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def _trained_run(workdir):
    from moe_lora_rl.checks.layouts import DEFAULT_LAYOUTS, resolve_models
    from moe_lora_rl.lora import LoRAConfig

    return dict(models=resolve_models(None), layouts=DEFAULT_LAYOUTS, cfg=LoRAConfig(rank=4, alpha=8.0),
                workdir=workdir)


@pytest.fixture(scope="session")
def lora_trained(lora_runs):
    """Expert LoRA (rank 4, alpha 8) trained 3 steps at every default layout, both models, once per session:
    tests/distributed/test_lora_layouts.py compares the layouts, tests/e2e/test_refit_vllm.py pushes the adapters
    trained at tp2ep2 and pp2ep2 to vLLM. Returns (models, report, workdir: blobs LAYOUT-mI.pt and data.pt, the LoRAConfig)."""
    report, work = lora_runs("lora_trained")
    run = _trained_run(work)
    return run["models"], report, work, run["cfg"]


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
# Likewise LORA_RUNS = {name: {"fixture": F, "run": f(workdir) -> checks.lora_layouts.run's keyword arguments}}, read
# with lora_runs(name) -> (report, workdir), needed by the selected tests that use fixture F: those runs go in
# lockstep (lora_layouts.run_many: one launch for every reference, then one per world size).
# Running one file alone launches that file's jobs alone.
_WANTED = pytest.StashKey[dict]()
LORA_RUNS = {"lora_trained": {"fixture": "lora_trained", "run": _trained_run}}


def _skipped(item) -> bool:
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True) for m in item.iter_markers())


def pytest_collection_finish(session):
    tables = {"LAUNCH": ({}, []), "LORA_RUNS": ({}, [])}
    for item in session.items:
        for attr, (jobs, wanted) in tables.items():
            declared = dict(getattr(item.module, attr, None) or {})
            declared.update(LORA_RUNS if attr == "LORA_RUNS" else {})
            for name, job in declared.items():
                assert jobs.setdefault(name, job) is job, f"two test modules declare the {attr} job {name!r}"
                params, uses = getattr(item, "callspec", None), job.get("fixture")
                if name in wanted or _skipped(item) or (uses and uses not in item.fixturenames):
                    continue
                if job.get("param") is None or (params and job["param"] in params.params.values()):
                    wanted.append(name)
    session.config.stash[_WANTED] = tables


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory):
    """shared_launch(name) -> (the job's result as run_torchrun returns it, its workdir); the first call of a world
    size runs every wanted job of that size in one launch (a failed launch fails each of its jobs' tests)."""
    from moe_lora_rl.checks.torchrun import run_torchrun_jobs

    jobs, wanted = request.config.stash[_WANTED]["LAUNCH"]

    def launch(names, dirs):
        nproc = jobs[names[0]]["nproc"]
        return run_torchrun_jobs(nproc, [(jobs[n]["module"], jobs[n]["args"](dirs[n])) for n in names])
    return _batches(tmp_path_factory, jobs, wanted, launch, lambda a, b: a["nproc"] == b["nproc"])


@pytest.fixture(scope="session")
def lora_runs(request, tmp_path_factory):
    """lora_runs(name) -> (its checks.lora_layouts report, its workdir); the first call runs every wanted run."""
    from moe_lora_rl.checks.lora_layouts import run_many

    jobs, wanted = request.config.stash[_WANTED]["LORA_RUNS"]
    def run(names, dirs):
        return run_many([jobs[n]["run"](dirs[n]) for n in names])
    return _batches(tmp_path_factory, jobs, wanted, run, lambda a, b: True)


def _batches(tmp_path_factory, jobs, wanted, run, together):
    """get(name) -> (result, workdir); its first call runs, through run(names, workdirs) -> results, every wanted job
    not run yet that goes together with it (just it when it is not wanted); a failure fails each of those jobs."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            names = [n for n in wanted if n not in done and together(jobs[n], jobs[name])]
            names = names if name in names else [name]
            dirs = {n: tmp_path_factory.mktemp(n) for n in names}
            try:
                done.update({n: (r, dirs[n]) for n, r in zip(names, run(names, dirs))})
            except Exception as e:  # noqa: BLE001 - re-raised for each job of the batch
                done.update({n: e for n in names})
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]
    return get
