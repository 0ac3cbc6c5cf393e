"""The driver refuses a bad run before any process group or engine starts: one line naming the value, exit 2."""
import subprocess
import sys

import pytest

from moe_lora_rl.rl import config
from moe_lora_rl.rl.config import preflight


def check(overrides, world):
    return preflight.check(config.load(overrides), world)


def test_layout_against_world_and_model():
    with pytest.raises(ValueError, match="world size"):
        check(["layout.tp=2", "layout.ep=2"], 1)
    with pytest.raises(ValueError, match="ep=3"):
        check(["layout.ep=3"], 3)               # 128 experts do not split over 3
    with pytest.raises(ValueError, match="micro_batch_size=16"):
        check(["algo.group_size=4", "algo.prompts_per_step=6"], 2)  # 24 responses, 2 DP ranks x 16
    arch = check([], 2)
    assert (arch.num_experts, arch.topk) == (128, 8) and any(arch.moe_layers)      # the default model
    assert check(["model.size=small"], 2).num_experts == 16                        # the former default, by name


def test_grouped_experts_needs_the_legacy_grouped_mlp(monkeypatch):
    from moe_lora_rl.megatron import cpu_support

    assert check(["runtime.experts=grouped"], 2).num_experts == 128          # megatron-core 0.16 has it
    assert preflight.run_config(config.load(["runtime.experts=grouped"])).grouped_experts is True
    with pytest.raises(ValueError, match="bf16-only"):
        check(["runtime.experts=grouped", "runtime.device=cuda"], 2)
    monkeypatch.setattr(cpu_support, "mcore_version", lambda: "0.19.2")
    with pytest.raises(ValueError, match="megatron-core 0.19.2 has no legacy GroupedMLP"):
        check(["runtime.experts=grouped"], 2)


def test_async_refusals():
    for overrides, world, needle in (
            (["mode=async", "max_staleness=0"], 2, "max_staleness=0"),
            (["mode=async", "inflight=pin", "serving=merged"], 2, "inflight=pin with serving=merged"),
            (["mode=async", "inflight=pin", "max_staleness=4"], 2, "rollout.max_versions=4"),
            (["mode=async", "algo.group_size=3", "algo.prompts_per_step=3", "algo.micro_batch_size=1"], 2,
             "does not split over data-parallel size 2"),
            (["mode=async", "delay.train_s=-1"], 2, "delay.train_s=-1"),
            (["rollout.threads=0"], 2, "rollout.threads=0 must be an integer >= 1")):
        with pytest.raises(ValueError, match=needle):
            check(overrides, world)
    check(["mode=async", "inflight=pin", "max_staleness=3"], 2)          # 4 versions fit rollout.max_versions=4
    assert config.load(["mode=async", "max_staleness=0", "mode=sync"]).mode == "sync"  # the bound is async's only


def test_cli_one_line_errors(train_cli):
    for args, needle in ((["lora.rnk=4"], "unknown config key"), (["replay=r4"], "replay='r4'"),
                         (["data.train_file=/nonexistent.parquet"], "/nonexistent.parquet"),
                         (["mode=async", "max_staleness=0"], "max_staleness=0"),
                         (["policies=[{name: a}, {name: a}]"], "policies: name 'a' is given 2 times"),
                         (["rollout.base_from=peer"], "rollout.base_from='peer' with rollout.engines=1: a restarted"),
                         (["rollout.base_from=nfs"], "rollout.base_from='nfs'; choose one of ('disk', 'trainer', 'peer')"),
                         (["rollout.base_from=trainer", "rollout.base_transport=shm", "rollout.node=n1"],
                          "rollout.base_transport='shm' for an engine on n1: shared memory reaches"),
                         (["rollout.base_from=trainer", "rollout.base_bucket_mb=400", "rollout.node=n1"],
                          "rollout.base_bucket_mb=400: a bucket sent inline over http takes about 534 MiB"),
                         (["rollout.base_from=trainer", "rollout.base_transport=cuda"],
                          "rollout.base_transport='cuda'; choose one of ('auto', 'shm', 'http', 'gloo', 'nccl', 'ipc')"),
                         (["rollout.base_from=trainer", "rollout.base_transport=nccl"],
                          "rollout.base_transport='nccl' for an engine given no GPU"),
                         (["rollout.base_from=trainer", "rollout.base_transport=ipc", "rollout.node=n1",
                           "rollout.gpus=[0]"],
                          "rollout.base_transport='ipc' for an engine on n1: a CUDA IPC handle reaches engines on")):
        rc, lines, err = train_cli(*args)
        assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_cli_error_of_the_process_is_one_line():
    p = subprocess.run([sys.executable, "-m", "moe_lora_rl.train", "replay=r4"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "replay='r4'" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_replicas_prompt_template_and_resume_refusals(tmp_path, monkeypatch):
    import os
    import shutil

    from moe_lora_rl.models import get_model

    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"rollout.engines={cores + 1}: {cores + 1} CPU engines on this host"):
        check([f"rollout.engines={cores + 1}"], 2)
    check([f"rollout.engines={cores}", "rollout.node=elsewhere"], 2)   # engines on another node: not this host's
    # a checkpoint whose tokenizer has no chat template (most base models)
    base = tmp_path / "base"
    shutil.copytree(get_model("glm4_moe", "small"), base)
    (base / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="data.prompt_template=chat: the tokenizer of .* has no chat template"):
        check([f"model.path={base}", "data.prompt_template=chat"], 2)
    check([f"model.path={base}", "data.prompt_template=auto"], 2)
    with pytest.raises(ValueError, match="resume=true: no checkpoint"):
        check([f"out_dir={tmp_path / 'run'}", "resume=true", "checkpoint_every=1"], 2)
    check([f"out_dir={tmp_path / 'run'}", "resume=auto", "checkpoint_every=1"], 2)     # nothing there: fresh


def test_plain_prompt_template():
    import transformers

    from moe_lora_rl.models import get_model
    from moe_lora_rl.data.prompting import encode_prompts, plain_text, resolve_template
    from moe_lora_rl.data.task import TaskSpec, make_split

    tok = transformers.AutoTokenizer.from_pretrained(get_model("glm4_moe", "tiny"))
    problems = make_split(TaskSpec(length=5, n_eval=4), "eval")[:2]
    assert resolve_template(tok, "auto") == "chat" and resolve_template(tok, "plain") == "plain"
    chat, plain = encode_prompts(tok, problems, "chat"), encode_prompts(tok, problems, "plain")
    assert tok.decode(plain[0]) == plain_text(problems[0]) == problems[0].question + "\n"
    assert "<|im_start|>" in tok.decode(chat[0]) and "<|im_start|>" not in tok.decode(plain[0])
    tok.chat_template = None
    assert resolve_template(tok, "auto") == "plain"
    with pytest.raises(ValueError, match="has no chat template"):
        resolve_template(tok, "chat")


def test_targets_the_model_lacks():
    """A target named for a linear the model does not have is refused before anything starts, naming the policy
    (qwen3_moe has no shared expert and no dense MLP layer; glm4_moe has both)."""
    q = ["model.family=qwen3_moe", "model.size=tiny"]
    assert preflight.check(config.load(q), 1).adaptable() == {"qkv", "proj", "expert_fc1", "expert_fc2"}
    with pytest.raises(ValueError, match=r"policies: 'b': lora.targets \['shared_experts'\] match no layer of this "
                                         r"model \(it has \['expert_fc1', 'expert_fc2', 'proj', 'qkv'\]\)"):
        check([*q, "policies=[{name: a}, {name: b, targets: [shared_experts]}]"], 1)
    with pytest.raises(ValueError, match=r"lora.targets \['dense_fc1'\] match no layer"):
        check([*q, "lora.targets=[experts, dense_fc1]"], 1)
    glm = check(["model.size=tiny", "policies=[{name: a, targets: [shared_experts, dense_mlp]}]"], 1)
    assert glm.adaptable() == {"qkv", "proj", "expert_fc1", "expert_fc2", "shared_fc1", "shared_fc2", "dense_fc1",
                               "dense_fc2"}


def test_answer_length_of_a_datasets_reference_column(tmp_path):
    """A dataset warm-started on data.reference_key: algo.max_response_tokens holds its longest reference answer
    (gsm8k_arith's "23 + 28 = 51\\n#### 51", 16 tokens on the built-in tokenizer), refused naming the row below it;
    controls: the same files with no warm start (no reference column, model.warm_start=false) take any length. The
    launcher's path (prompt_rows) measures the prompts too, in the same tokenizer load."""
    import transformers

    from moe_lora_rl.data import write

    paths = write("gsm8k_arith", tmp_path, n_eval=8)
    files = [f"data.train_files={paths['train']}", f"data.val_files={paths['val']}"]
    tok = transformers.AutoTokenizer.from_pretrained(str(preflight.base_model_dir(config.load([]))))

    def length(*over):
        preflight.check_answer_length(config.load([*files, *over]), tok)

    length("data.reference_key=extra_info.answer", "algo.max_response_tokens=16")
    with pytest.raises(ValueError, match=r"algo.max_response_tokens=15 is below the longest reference answer the "
                                         r"warm start teaches \(data.reference_key='extra_info.answer', train row "
                                         r"\d+: 16 tokens\)"):
        length("data.reference_key=extra_info.answer", "algo.max_response_tokens=15")
    length("algo.max_response_tokens=4")                                                # no reference column
    length("data.reference_key=extra_info.answer", "algo.max_response_tokens=4", "model.warm_start=false")
    with pytest.raises(ValueError, match=r"train row 0 \(data_source 'openai/gsm8k'\)"):
        preflight.check(config.load([*files, "data.max_prompt_length=40"]), 2, prompt_rows=100)
    check([*files, "data.max_prompt_length=40"], 2)       # a rank's check measures no prompts (it does as it goes)
