"""An unsupported vLLM is refused at start in one line naming its version, before vLLM is imported or an engine,
server or verl replica is made (vllm/compat.py)."""
import sys

import pytest

from moe_lora_rl.vllm import compat


def _installed(monkeypatch, version):
    monkeypatch.setattr(compat.importlib.metadata, "version", lambda dist: version)
    monkeypatch.setitem(sys.modules, "vllm", None)              # any import of vLLM now raises ImportError


@pytest.mark.parametrize("version", ["0.24.0", "0.34.0", "0.33.1+cu130"])
def test_make_engine_and_start_server_refuse_before_vllm(monkeypatch, tmp_path, version):
    from moe_lora_rl.rollout import openai_server, vllm_engine as engine

    _installed(monkeypatch, version)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(openai_server.subprocess, "Popen", lambda *a, **k: pytest.fail("server process started"))
    v = version.replace(".", r"\.").replace("+", r"\+")
    for what, call in (("make_engine", lambda: engine.make_engine("model")),
                       ("start_server", lambda: openai_server.start_server("model", 1, log_dir=tmp_path))):
        with pytest.raises(ValueError, match=rf"^vLLM {v}: {what} is written for vLLM 0\.32\.x; nothing was changed "
                                             r"in vLLM \(install vllm 0\.32\.x; .*upstream\.report"):
            call()


def test_supported_version_passes_the_check(monkeypatch):
    """Control: 0.32.x passes the check, so make_engine goes on to import vLLM (here: the ImportError)."""
    from moe_lora_rl.rollout import vllm_engine as engine

    _installed(monkeypatch, "0.32.0+cpu")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert compat.check_vllm_version() == "0.32.0+cpu"
    with pytest.raises(ImportError):
        engine.make_engine("model")


@pytest.mark.verl
def test_verl_replica_refuses_before_its_servers(monkeypatch):
    from moe_lora_rl.integration.verl import replica

    monkeypatch.setattr(compat.importlib.metadata, "version", lambda dist: "0.24.0")
    monkeypatch.setattr(replica.vLLMReplica, "__init__", lambda *a, **k: pytest.fail("verl's replica was made"))
    with pytest.raises(ValueError, match=r"^vLLM 0\.24\.0: the moe_lora_vllm rollout is written for vLLM 0\.32\.x"):
        replica.MoELoRAvLLMReplica(replica_rank=0, config=None, model_config=None)
