"""verl's real config (ppo_megatron_trainer, hydra compose) with our overrides: it resolves to our engine and replica,
the vLLM arguments built by verl's own launch_server through our replica's hooks are ours, and conflicting or
misspelt options are one-line errors naming the key and the value. The plugin registers nothing unless imported."""
import asyncio
import os
import subprocess
import sys
import types

import pytest

from kit.import_inert import IMPORT_CHECK, facts

pytestmark = pytest.mark.verl

ENGINE = "moe_lora_rl.integration.verl.plugin.MoELoRAEngineConfig"


def overrides(path, **extra):
    ov = {"actor_rollout_ref.actor.megatron._target_": ENGINE,
          "actor_rollout_ref.model.external_lib": "moe_lora_rl.integration.verl.plugin",
          "actor_rollout_ref.model.path": path,
          "actor_rollout_ref.model.lora.rank": 4,
          "+actor_rollout_ref.model.lora.adapter_layout": "per_expert",
          "actor_rollout_ref.rollout.name": "moe_lora_vllm",
          "actor_rollout_ref.actor.megatron.dtype": "float32",
          "+actor_rollout_ref.actor.megatron.device": "cpu",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
          "trainer.use_v1": False,
          "reward.reward_manager.source": "importlib", "reward.reward_manager.name": "FiniteRewardManager",
          "reward.reward_manager.module.path": "pkg://moe_lora_rl.integration.verl.reward_manager"}
    ov.update(extra)
    return [f"{k}={v}" for k, v in ov.items() if v is not None]


@pytest.fixture(scope="module")
def compose():
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from moe_lora_rl.models import get_model

    path = str(get_model("glm4_moe", "tiny"))
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

    def make(**extra):
        with initialize_config_dir(config_dir=cfg_dir, version_base=None):
            return hydra_compose("ppo_megatron_trainer", overrides=overrides(path, **extra))

    return make


def test_overrides_resolve_to_our_engine_and_replica(compose):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from moe_lora_rl.integration.verl.verl_config import MoELoRAEngineConfig, check_config
    from moe_lora_rl.megatron.layout import Layout

    cfg = compose(**{"actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
                     "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 2})
    check_config(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor.engine, MoELoRAEngineConfig) and actor.engine.strategy == "moe_lora"
    # expert_tensor_parallel_size unset follows megatron-core's default (ETP = TP); set, it is kept
    assert actor.engine.layout() == Layout(tp=2, ep=2, etp=2) and actor.engine.run_config().dtype == "fp32"
    etp1 = compose(**{"actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
                      "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": 1})
    assert omega_conf_to_dataclass(etp1.actor_rollout_ref.actor).engine.layout() == Layout(tp=2, etp=1)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.model)          # HFModelConfig imports external_lib: registers
    from moe_lora_rl.integration.verl.engine import MoELoRAEngine
    from moe_lora_rl.integration.verl.replica import MoELoRAvLLMReplica

    assert EngineRegistry.get_engine_cls("language_model", actor.engine.strategy) is MoELoRAEngine
    assert RolloutReplicaRegistry.get(cfg.actor_rollout_ref.rollout.name) is MoELoRAvLLMReplica
    # verl's stock Megatron engine is still what the stock strategy selects (registration adds, never replaces)
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is not MoELoRAEngine


def _launch_args(server_cls, cfg) -> dict:
    """The vLLM CLI arguments verl's own launch_server builds (run_server captured instead of started)."""

    class Capture(server_cls):
        async def run_server(self, args):
            self.captured = args

    s = object.__new__(Capture)
    s.config = s._init_config(cfg.actor_rollout_ref.rollout)
    s.model_config = s._init_model_config(cfg.actor_rollout_ref.model)
    s._disaggregation_role, s.replica_rank, s.node_rank, s.nnodes, s.gpus_per_node = "null", 0, 0, 1, 1
    s.workers, s._master_address, s._master_port, s._dp_rpc_port = [None], None, None, None
    s.profiler_controller = types.SimpleNamespace(check_enable=lambda: False)
    asyncio.run(s.launch_server())
    return vars(s.captured) | {"_sleep_level": s._resolve_sleep_level(),
                               "_routes_from_capture": getattr(s, "moe_routes", None) is not None}


@pytest.mark.vllm
def test_vllm_engine_args_through_replica_hooks(compose):
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from moe_lora_rl.integration.verl.replica import MoELoRAvLLMHttpServer

    for prefix_caching, backend in ((True, "naive"), (False, "moe_lora"), (True, "moe_lora_base")):
        cfg = compose(**{"actor_rollout_ref.rollout.enable_prefix_caching": prefix_caching,
                         "actor_rollout_ref.rollout.enforce_eager": False,
                         "actor_rollout_ref.rollout.checkpoint_engine.backend": backend})
        ours = _launch_args(MoELoRAvLLMHttpServer, cfg)
        assert ours["worker_extension_cls"] == "moe_lora_rl.integration.verl.vllm_extension.VerlMoELoRAWorkerExtension"
        # colocated syncs and moe_lora_base carry the base once (dummy start is fine); moe_lora carries adapters only
        assert ours["load_format"] == ("auto" if backend == "moe_lora" else "dummy"), (backend, ours["load_format"])
        assert not ours.get("enable_lora") and not ours.get("fully_sharded_loras")
        assert ours["enforce_eager"] is True and ours["enable_prefix_caching"] is prefix_caching
        assert ours["_sleep_level"] == 1                       # base weights stay resident between adapter refits
    # negative control: verl's own server with the same config turns vLLM's LoRA on and compiles
    stock = _launch_args(vLLMHttpServer, cfg)
    assert stock["enable_lora"] is True and stock["enforce_eager"] is False
    assert stock["worker_extension_cls"] != ours["worker_extension_cls"]
    # R3: our replica captures the routes itself; verl's own server turns on vLLM's routed-experts return
    cfg = compose(**{"actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
                     "actor_rollout_ref.actor.megatron.router_replay.mode": "R3"})
    ours, stock = _launch_args(MoELoRAvLLMHttpServer, cfg), _launch_args(vLLMHttpServer, cfg)
    assert not ours.get("enable_return_routed_experts") and ours["_routes_from_capture"]
    assert stock["enable_return_routed_experts"] is True


@pytest.mark.vllm
def test_mla_engine_settings_through_replica_hooks(compose, tmp_path, capsys):
    """verl's server is given what our own engine gives an MLA checkpoint (vllm/mla_config.engine_args): DeepSeek-V3's
    routing keys where config.json lacks them (one line), the CPU MLA backend; engine_kwargs.vllm's values win."""
    import json

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from moe_lora_rl.integration.verl.replica import MoELoRAvLLMHttpServer
    from moe_lora_rl.models import get_model

    src = get_model("deepseek_v3", "tiny_rope")
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    for key in ("topk_method", "scoring_func"):         # as HF's save_pretrained writes a DeepSeek-V3 checkpoint
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mla = {"actor_rollout_ref.model.path": str(tmp_path)}
    ours = _launch_args(MoELoRAvLLMHttpServer, compose(**mla))
    assert ours["attention_backend"] == "CPU_MLA"
    assert ours["hf_overrides"] == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    said = [l for l in capsys.readouterr().out.splitlines() if "has no topk_method / scoring_func" in l]
    assert len(said) == 1 and "noaux_tc" in said[0]
    mine = _launch_args(MoELoRAvLLMHttpServer, compose(**mla, **{
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend": "TORCH_SDPA",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides": "{scoring_func: softmax}"}))
    assert mine["attention_backend"] == "TORCH_SDPA"
    assert mine["hf_overrides"] == {"topk_method": "noaux_tc", "scoring_func": "softmax"}
    # controls: verl's own server passes neither (vLLM then fails to load the checkpoint); a GQA model gets neither
    stock = _launch_args(vLLMHttpServer, compose(**mla))
    assert not stock.get("attention_backend") and not stock.get("hf_overrides")
    glm = _launch_args(MoELoRAvLLMHttpServer, compose())
    assert not glm.get("attention_backend") and not glm.get("hf_overrides")


def test_hybrid_engine_settings_through_replica_hooks(compose, monkeypatch, capsys):
    """verl's server is given what our own engine gives the hybrid family on a CPU without torchvision (make_engine:
    vllm/vision_import_fix.scoped around the engine, vllm/hybrid_config.prefix_caching): its workers, processes of
    their own, load the model through our CPU worker class (the fix around their model load); the engine is built
    inside the fix (the architecture's inspection); prefix caching is off when chunked prefill is; a worker class
    named in engine_kwargs.vllm wins. Controls: verl's own server and a GQA model get no worker class."""
    import importlib.util

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    from moe_lora_rl.integration.verl.replica import MoELoRAvLLMHttpServer
    from moe_lora_rl.models import get_model
    from moe_lora_rl.vllm import vision_import_fix

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name, *a))
    hybrid = {"actor_rollout_ref.model.path": str(get_model("qwen3_5_moe", "tiny"))}
    ours = _launch_args(MoELoRAvLLMHttpServer, compose(**hybrid))
    assert ours["worker_cls"] == vision_import_fix.WORKER_CLS == "moe_lora_rl.vllm.cpu_worker.VisionFixCPUWorker"
    assert ours["enable_prefix_caching"] is True and ours["enable_chunked_prefill"] is True   # exact as asked
    assert sum("workers load it with the PIL twin" in l for l in capsys.readouterr().out.splitlines()) == 1
    off = _launch_args(MoELoRAvLLMHttpServer, compose(**hybrid, **{
        "actor_rollout_ref.rollout.enable_chunked_prefill": False,
        "actor_rollout_ref.rollout.max_num_batched_tokens": 8192}))
    assert off["enable_prefix_caching"] is False and off["enable_chunked_prefill"] is False
    mine = _launch_args(MoELoRAvLLMHttpServer, compose(**hybrid, **{
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_cls": "my.Worker"}))
    assert mine["worker_cls"] == "my.Worker"
    # the engine is built inside the fix (vLLM inspects the architecture there), and only there
    from vllm.model_executor.models import registry

    seen = []

    async def build(self, args):
        seen.append((registry._run_in_subprocess is vision_import_fix._in_process,
                     vision_import_fix.IMAGE_MODULE in sys.modules))
        self.engine = types.SimpleNamespace(pause_generation=lambda wait_for_inflight_requests=True: None)
    monkeypatch.setattr(vLLMHttpServer, "run_server", build)
    server = object.__new__(MoELoRAvLLMHttpServer)
    server.model_config = types.SimpleNamespace(local_path=hybrid["actor_rollout_ref.model.path"])
    asyncio.run(server.run_server(None))
    assert seen == [(True, True)] and registry._run_in_subprocess is not vision_import_fix._in_process
    # controls: verl's own server and a GQA checkpoint keep vLLM's worker class
    assert _launch_args(vLLMHttpServer, compose(**hybrid)).get("worker_cls", "auto") == "auto"
    assert _launch_args(MoELoRAvLLMHttpServer, compose()).get("worker_cls", "auto") == "auto"


@pytest.mark.parametrize("extra, match", [
    ({"+actor_rollout_ref.model.lora.adapter_layuot": "shared"},
     r"actor_rollout_ref.model.lora.adapter_layuot='shared' is not a key our override knows"),
    ({"actor_rollout_ref.model.external_lib": None},
     r"actor_rollout_ref.model.external_lib=None: set it to moe_lora_rl.integration.verl.plugin"),
    ({"+actor_rollout_ref.model.lora.fully_sharded_loras": True},
     r"actor_rollout_ref.model.lora.fully_sharded_loras=True is not a key our override knows"),
    ({"actor_rollout_ref.model.lora.merge": True}, r"actor_rollout_ref.model.lora.merge=True: our replica serves the adapters unmerged"),
    ({"+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_lora": True},
     r"actor_rollout_ref.rollout.engine_kwargs.vllm.enable_lora=True turns on vLLM's own LoRA"),
    ({"+actor_rollout_ref.model.lora.adapter_layout": "per_rank"}, r"adapter_layout='per_rank'"),
    ({"actor_rollout_ref.model.lora.rank": 0}, r"actor_rollout_ref.model.lora.rank=0"),
    ({"actor_rollout_ref.rollout.name": "vllm"}, r"actor_rollout_ref.rollout.name='vllm'"),
    ({"actor_rollout_ref.actor.megatron._target_": "verl.workers.config.McoreEngineConfig"},
     r"actor_rollout_ref.actor.megatron._target_='verl.workers.config.McoreEngineConfig'"),
    ({"actor_rollout_ref.actor.megatron.router_replay.mode": "R3"},
     r"router_replay.mode='R3' needs actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
    ({"+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_return_routed_experts": True,
      "actor_rollout_ref.rollout.enable_rollout_routing_replay": True},
     r"engine_kwargs.vllm.enable_return_routed_experts=True turns on vLLM's own routes next to ours "
     r"\(actor_rollout_ref.rollout.enable_rollout_routing_replay=True\)"),
    ({"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"},
     r"loss_agg_mode=seq-mean-token-sum-norm needs actor_rollout_ref.actor.loss_scale_factor"),
])
def test_bad_config_is_a_one_line_error(compose, extra, match):
    from moe_lora_rl.integration.verl.verl_config import check_config

    with pytest.raises(ValueError, match=match) as e:
        check_config(compose(**extra))
    assert "\n" not in str(e.value)


def test_seq_mean_token_sum_norm_with_a_constant_factor_is_accepted(compose):
    """The refusal above names the key; set, the same mode passes (verl then divides by that constant)."""
    from moe_lora_rl.integration.verl.verl_config import check_config

    check_config(compose(**{"actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
                            "actor_rollout_ref.actor.loss_scale_factor": 64}))


def test_bad_engine_values_and_versions():
    from moe_lora_rl.integration.verl.verl_config import MoELoRAEngineConfig, check_verl_version
    from moe_lora_rl.integration.verl.routes_dataproto import routes_from_verl
    import torch

    with pytest.raises(ValueError, match=r"megatron.dtype='float16'"):
        MoELoRAEngineConfig(dtype="float16")
    with pytest.raises(ValueError, match=r"megatron.device='tpu'"):
        MoELoRAEngineConfig(device="tpu")
    with pytest.raises(ValueError, match=r"verl version '0.7.0' is not supported"):
        check_verl_version("0.7.0")
    r = torch.zeros(5, 3, 2, dtype=torch.int16)        # 3 layers: neither 4 layers nor 3 MoE layers... of 2 MoE
    with pytest.raises(ValueError, match="layer axis of 3 matches neither the model's 4 layers nor its 2 MoE"):
        routes_from_verl([r], [5], num_layers=4, moe_layer_ids=[2, 3], num_experts=8, topk=2)
    with pytest.raises(ValueError, match="covers 5 tokens, the sample has 7"):
        routes_from_verl([torch.zeros(5, 4, 2, dtype=torch.int16)], [7], num_layers=4, moe_layer_ids=[2, 3],
                         num_experts=8, topk=2)


def test_routes_from_verl_layer_indexing():
    """verl indexes its layer axis by global layer number when it spans every layer, else by MoE ordinal."""
    import torch

    from moe_lora_rl.integration.verl.routes_dataproto import routes_from_verl

    full = torch.arange(6 * 4 * 2, dtype=torch.int16).reshape(6, 4, 2) % 8       # [tokens, all 4 layers, k]
    a = routes_from_verl([full], [6], num_layers=4, moe_layer_ids=[1, 3], num_experts=8, topk=2)
    b = routes_from_verl([full[:, [1, 3]]], [6], num_layers=4, moe_layer_ids=[1, 3], num_experts=8, topk=2)
    assert a.layer_ids == (1, 3) and a.samples[0].shape == (5, 2, 2)
    assert (a.samples[0] == full[:5, [1, 3]].numpy()).all() and (a.samples[0] == b.samples[0]).all()
    assert not (a.samples[0] == full[:5, [0, 1]].numpy()).all()               # the dense layer's rows are not used


def _start(code, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code + "print('ok')\n"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONWARNINGS": "ignore"} | env)


def _check(p: subprocess.Popen) -> None:
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0 and stdout.strip().endswith("ok"), stderr[-2000:]
    p.stdout_text = stdout


REGISTRIES = ("from verl.workers.engine.base import EngineRegistry\n"
              "from verl.plugin.platform.platform_manager import PlatformRegistry\n"
              "def ours(): return 'moe_lora' in EngineRegistry._engines['language_model']\n")


def test_plugin_is_inert_unless_imported():
    """Three fresh processes, started together (each imports verl: most of the time). The first also runs
    test_cpu_support's check that importing every module of the package patches nothing (tests/kit/import_inert.py),
    before anything imports verl."""
    # our other modules (algos, the vLLM plugin; every module import_inert walks) import no verl and register nothing
    first = _start(IMPORT_CHECK +
         "import sys, moe_lora_rl, moe_lora_rl.algos, moe_lora_rl.vllm, moe_lora_rl.integration.verl\n"
         "assert 'verl' not in sys.modules, 'importing algos or the integration package must not import verl'\n"
         "import verl\n" + REGISTRIES +
         "assert not ours() and PlatformRegistry.get('moe_lora_cpu') is None\n"
         # no module but plugin.py registers at import: every other module of the override is imported here
         "import moe_lora_rl.integration.verl.verl_config, moe_lora_rl.integration.verl.engine\n"
         "import moe_lora_rl.integration.verl.platform_cpu, moe_lora_rl.integration.verl.checkpoint_engine\n"
         "import moe_lora_rl.integration.verl.replica, moe_lora_rl.integration.verl.task_runner\n"
         "from verl.checkpoint_engine.base import CheckpointEngineRegistry\n"
         "assert not ours() and PlatformRegistry.get('moe_lora_cpu') is None\n"
         "assert 'moe_lora' not in CheckpointEngineRegistry._registry\n"
         "from hydra.utils import get_class\n"
         "cls = get_class('" + ENGINE + "')\n"        # what verl does with the engine _target_
         "assert ours() and PlatformRegistry.get('moe_lora_cpu') is not None\n"
         "assert 'moe_lora' in CheckpointEngineRegistry._registry\n"
         "from moe_lora_rl.integration.verl.verl_config import MoELoRAEngineConfig\n"
         "assert cls is MoELoRAEngineConfig\n")
    # verl imports the package as external_lib: registered; the CPU platform is never auto-detected
    second = _start("import verl\n" + REGISTRIES +
         "assert not ours()\n"
         "from verl.utils.import_utils import import_external_libs\n"
         "import_external_libs('moe_lora_rl.integration.verl.plugin')\n"
         "assert ours()\n"
         "assert not PlatformRegistry.get('moe_lora_cpu')().is_platform_available(use_smi_check=True)\n"
         "from verl.plugin.platform.platform_manager import _detect_platform_name\n"
         "assert _detect_platform_name() != 'moe_lora_cpu'\n")
    # Ray workers on the CPU platform: verl imports the plugin while verl itself is imported
    third = _start("import verl\n" + REGISTRIES + "assert ours() and PlatformRegistry.get('moe_lora_cpu') is not None\n",
                   VERL_USE_EXTERNAL_MODULES="moe_lora_rl.integration.verl.plugin")
    for p in (first, second, third):
        _check(p)
    out = facts(first.stdout_text)
    assert int(out["IMPORTED"]) > 20 and out["CHANGED"] == "[]", out


def test_task_runner_swaps_the_worker_only_on_the_cpu_platform(compose, monkeypatch):
    """The recipe's task runner keeps verl's actor-rollout worker unless VERL_PLATFORM selects our CPU platform; the
    gloo-only worker refuses to start anywhere else."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from moe_lora_rl.integration.verl.cpu_worker import CPUActorRolloutRefWorker, init_gloo_process_group
    from moe_lora_rl.integration.verl.task_runner import MoELoRATaskRunner

    def mapped(runner):
        return {r: c.__ray_metadata__.modified_class.__ray_actor_class__ for r, c in runner.role_worker_mapping.items()}

    cfg = compose()
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    r = MoELoRATaskRunner()
    assert r.add_actor_rollout_worker(cfg)[0] is ActorRolloutRefWorker
    assert set(mapped(r).values()) == {ActorRolloutRefWorker}
    with pytest.raises(ValueError, match="VERL_PLATFORM=moe_lora_cpu, got VERL_PLATFORM=''"):
        init_gloo_process_group()
    monkeypatch.setenv("VERL_PLATFORM", "moe_lora_cpu")
    r = MoELoRATaskRunner()
    assert r.add_actor_rollout_worker(cfg)[0] is CPUActorRolloutRefWorker
    assert set(mapped(r).values()) == {CPUActorRolloutRefWorker}


def test_target_modules_are_honoured_or_refused_in_one_line():
    """verl's model.lora.target_modules (Megatron module names) chooses our targets; verl's default list and
    'all-linear' mean every linear the model has; a name we cannot honour, a wildcard, exclude_modules or a
    disagreement with our own `targets` is refused naming the key."""
    from moe_lora_rl.integration.verl.verl_config import lora_config

    cfg = lambda **kw: lora_config({"rank": 4, **kw})  # noqa: E731
    mla = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    assert set(cfg(target_modules=mla).resolved_targets()) == {"q_down", "q_up", "kv_down", "kv_up", "proj"}
    assert set(cfg(target_modules=["linear_fc2"]).resolved_targets()) == {"dense_fc2", "shared_fc2", "expert_fc2"}
    assert cfg(target_modules=["experts"]).resolved_targets() == ("expert_fc1", "expert_fc2")
    everything = cfg().resolved_targets()
    assert cfg(target_modules="all-linear").resolved_targets() == everything
    assert cfg(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]).resolved_targets() == everything
    assert cfg(targets=["experts"], target_modules=["experts"]).resolved_targets() == ("expert_fc1", "expert_fc2")
    for kw, msg in [(dict(target_modules=["*.layers.0.*.linear_qkv"]), r"target_modules: \['\*\.layers\.0"),
                    (dict(target_modules=["linear_q"]), r"target_modules: \['linear_q'\] are not module names"),
                    (dict(targets=["experts"], target_modules=mla), "disagree; set one of them"),
                    (dict(exclude_modules=["linear_proj"]), r"exclude_modules=\['linear_proj'\]: name what to adapt")]:
        with pytest.raises(ValueError, match=msg):
            cfg(**kw)
