"""The run config: recipes/train.yaml composed by hydra over the TrainConfig schema, overrides from a command-line
list, strict keys and one-line errors naming the bad key or value."""
import pytest

pytest.importorskip("hydra")

from moe_lora_rl.rl import config as C  # noqa: E402


def test_recipe_defaults_match_schema_defaults():
    cfg = C.load([])
    assert cfg == C.TrainConfig()      # the recipe restates the schema's defaults; a drift shows here
    assert cfg.lora.lora_config().resolved_targets() == ("expert_fc1", "expert_fc2", "qkv", "proj", "q_down", "q_up",
                                                         "q", "kv_down", "kv_up", "linear_in", "linear_out")
    # attention: GQA's, MLA's and the delta-net's (a model adapts those it has)


def test_overrides_from_command_line_list():
    cfg = C.load(["layout.tp=2", "layout.ep=2", "lora.rank=16", "lora.alpha=32", "lora.adapter_layout=shared",
                  "lora.targets=[experts]", "replay=r2", "serving=merged", "algo.group_size=4",
                  "algo.prompts_per_step=4", "algo.micro_batch_size=8", "algo.lr=0", "steps=3", "seed=7",
                  "runtime.rollout_dtype=float32", "checkpoint_every=1", "resume=true"])
    assert cfg.layout.layout().name == "tp2ep2"
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.adapter_layout, cfg.lora.targets) == (16, 32.0, "shared",
                                                                                          ["experts"])
    assert cfg.lora.lora_config().scale == 2.0
    assert (cfg.replay, cfg.serving, cfg.steps, cfg.seed, cfg.algo.lr) == ("r2", "merged", 3, 7, 0.0)
    assert cfg.algo.group_size * cfg.algo.prompts_per_step == 16
    assert cfg.runtime.rollout_dtype == "float32" and cfg.resume is True
    # negative control: the defaults differ from every overridden value
    d = C.load([])
    assert (d.layout.tp, d.lora.rank, d.replay, d.serving, d.steps, d.seed) != (2, 16, "r2", "merged", 3, 7)


@pytest.mark.parametrize("override, message", [
    ("lora.rnk=3", "unknown config key 'lora.rnk'"),
    ("+lora.rnk=3", "unknown config key 'lora.rnk'"),
    ("+foo=1", "unknown config key 'foo'"),
    ("replay=r5", "replay='r5'"),
    ("serving=fused", "serving='fused'"),
    ("lora.rank=0", "rank=0"),
    ("lora.adapter_layout=blocks", "lora.adapter_layout='blocks'"),
    ("lora.targets=[experts,bogus]", "unknown LoRA targets ['bogus']"),
    ("layout.ep=0", "ep=0"),
    ("runtime.device=tpu", "runtime.device='tpu'"),
    ("algo.group_size=1", "algo.group_size=1"),
    ("algo.micro_batch_size=5", "algo.micro_batch_size=5"),
    ("algo.loss_mode=ppo", "algo.loss_mode='ppo'"),
    ("algo.rollout_is_threshold=0.5", "algo.rollout_is_threshold=0.5"),
    ("steps=abc", "steps"),
    ("data.train_file=/no/such.parquet", "'/no/such.parquet' does not exist"),
    ("model.size=huge", "'glm4_moe'/'huge'"),
    ("resume=true", "resume=true needs checkpoint_every"),
    ("free_routing_every=-1", "free_routing_every=-1"),
    ("runtime.experts=batched", "runtime.experts='batched'"),
    ("model.warm_steps=0", "model.warm_steps=0 must be an integer >= 1"),
    ("rollout.expert_precision=bf16", "rollout.expert_precision='bf16': expected one of ['fp32', 'serving']"),
])
def test_bad_values_one_line(override, message):
    with pytest.raises(ValueError) as e:
        C.load([override])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_unknown_key_in_a_recipe_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("defaults:\n  - moe_lora_rl_train_schema\n  - _self_\nalgo:\n  lrate: 1\n")
    with pytest.raises(ValueError, match="algo.lrate"):
        C.load([], config_name="bad", config_dir=tmp_path)


def test_dataset_files_parsed_at_load(tmp_path):
    pytest.importorskip("pyarrow")
    from moe_lora_rl.data.dataset import write_parquet
    from moe_lora_rl.data.task import TaskSpec

    good = write_parquet(TaskSpec(n_eval=16), "eval", tmp_path / "eval.parquet")
    cfg = C.load([f"data.train_file={good}", f"data.eval_file={good}"]).data     # the aliases of verl's names
    assert cfg.train_files == cfg.val_files == [str(good)] and cfg.train_file is None
    with pytest.raises(ValueError, match="data.train_files and data.val_files go together"):
        C.load([f"data.train_files={good}"])
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError) as e:
        C.load([f"data.train_file={bad}"])
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_warm_steps_choose_the_warm_start(tmp_path, monkeypatch):
    """model.warm_steps changes only the steps of the task's warm start (its own cached checkpoint); it is refused
    where no built-in warm start runs."""
    import json
    from moe_lora_rl.rl import inputs

    seen = []

    def fake(family, size, spec):
        seen.append(spec)
        (tmp_path / "moe_lora_rl_warm_start.json").write_text(json.dumps({"train_wall_s": 1.0}))
        return tmp_path

    monkeypatch.setattr("moe_lora_rl.data.warm_start.warm_started", fake)
    inputs.model_dir(C.load([], config_name="long"))
    inputs.model_dir(C.load(["model.warm_steps=500"], config_name="long"))
    default, longer = seen
    assert (default.steps, longer.steps) == (300, 500) and default.key() != longer.key()
    assert {k: v for k, v in longer.__dict__.items() if k != "steps"} == \
        {k: v for k, v in default.__dict__.items() if k != "steps"}
    with pytest.raises(ValueError, match="model.warm_steps=5 sets the built-in warm start's steps"):
        C.load(["model.warm_steps=5", "model.warm_start=false"])
