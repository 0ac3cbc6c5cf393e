"""The key table (integration/verl/keys.py) against verl 0.9.1's whole composed config: every key of
actor_rollout_ref.{model,actor,ref,rollout} in verl's Megatron trainer config and in our three recipe configs (main_ppo,
one-step-off, fully-async) has a row, verl's defaults and our recipe's values are accepted, and the table printed in
docs/verl.md is the table in the code. Control: a row taken out of the table makes the walk name its key."""
import os
from pathlib import Path

import pytest

from moe_lora_rl.integration.verl import keys

pytestmark = pytest.mark.verl
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "verl_moe_lora" / "config"
OURS = ["actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.rollout.name=moe_lora_vllm"]


def _compose(config_dir, name, overrides=()):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(name, overrides=list(overrides))


@pytest.fixture(scope="module")
def configs():
    import verl

    verl_dir = Path(os.path.dirname(verl.__file__)) / "trainer" / "config"
    return {"verl ppo_megatron_trainer": _compose(verl_dir, "ppo_megatron_trainer", OURS),
            **{f"recipe {n}": _compose(RECIPE, n, ["actor_rollout_ref.model.path=/nonexistent"])
               for n in ("verl_moe_lora", "verl_moe_lora_one_step_off", "verl_moe_lora_fully_async")}}


def refusals(cfg) -> list[str]:
    from moe_lora_rl.integration.verl.verl_config import engine_sections, key_refusals

    return key_refusals(engine_sections(cfg))


def test_every_key_of_verls_config_has_a_row_and_its_defaults_pass(configs):
    for name, cfg in configs.items():
        assert refusals(cfg) == [], name


def test_a_row_taken_out_is_named(configs, monkeypatch):
    """The control: each of these rows removed, the walk refuses exactly its key as unknown."""
    cfg = configs["verl ppo_megatron_trainer"]
    for path in ("actor.optim.min_lr", "model.lora.dropout_position", "rollout.*", "actor.profiler.*"):
        table = tuple(k for k in keys.TABLE if k.path != path)
        monkeypatch.setattr(keys, "_BY_PATH", {k.path: k for k in table})
        monkeypatch.setattr(keys, "TABLE", table)
        found = refusals(cfg)
        assert found and all("is not a key our override knows" in f for f in found), path
        assert any(f.startswith(f"actor_rollout_ref.{path.rstrip('*')}") for f in found), (path, found[:2])
        monkeypatch.undo()
    assert refusals(cfg) == []


@pytest.mark.parametrize("path, value, words", [
    ("actor.megatron.context_parallel_size", 2, "context parallelism is not supported"),
    ("actor.megatron.param_offload", True, "remove it"),
    ("model.lora.dropout_position", "post", "pre"),
    ("model.lora.lora_A_init_method", "normal", "kaiming"),
    ("model.lora.dtype", "bfloat16", "fp32"),
    ("actor.optim.optimizer", "muon", "AdamW"),
    ("model.override_config.attention_dropout", 0.1, "config.json"),
    ("model.lora.no_such_key", 1, "is not a key our override knows"),
])
def test_refusals_name_the_key_and_what_to_do(path, value, words):
    msg = keys.refusal(path, value)
    assert msg and msg.startswith(f"actor_rollout_ref.{path}={value!r}") and words in msg and "\n" not in msg


def test_ref_megatron_must_equal_the_actors():
    assert keys.refusal("ref.megatron.tensor_model_parallel_size", 2, 2) is None
    msg = keys.refusal("ref.megatron.tensor_model_parallel_size", 4, 2)
    assert "differs from actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2" in msg


def test_docs_print_the_table():
    text = (ROOT / "docs" / "verl.md").read_text()
    assert keys.markdown() in text, "docs/verl.md's key table is stale: python -m moe_lora_rl.integration.verl.keys"
