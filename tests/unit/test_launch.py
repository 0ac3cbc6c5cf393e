"""`moe-lora-rl train` refuses every user error before any rank starts, in one line with exit status 2 and no
traceback: the config, the data files, the prompts' lengths, the reward's import, signature and calls (one per
data_source: verl's default scorer raises NotImplementedError for a source it does not know). The successful
launch (ranks started by torch's elastic launcher) is the main job's smoke, tests/e2e/test_train.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_lora_rl.launch import main
from moe_lora_rl.data.dataset import write_rows

pytest.importorskip("pyarrow")

GSM = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Ann has 2 apples and buys 3. How many?"}],
       "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0}}
from reward_files import REWARDS  # noqa: E402  (tests/unit: one reward file for these tests)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    (d / "rewards.py").write_text(REWARDS)
    (d / "bad.parquet").write_bytes(b"PAR1 not parquet")
    (d / "noprompt.jsonl").write_text(json.dumps(GSM) + "\n" + json.dumps({**GSM, "prompt": ""}) + "\n")
    write_rows([GSM], d / "gsm.parquet")
    write_rows([{"question": "q", "answer": "a"}], d / "cols.parquet")
    write_rows([{**GSM, "data_source": "my/task"}], d / "unknown.parquet")
    return d


def refused(capsys, *argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("moe-lora-rl train: error: ")
    return err


def data(d, name):
    return [f"data.train_files={d / name}", f"data.val_files={d / name}"]


def test_refusals_before_any_rank(files, capsys):
    d = files
    assert "unknown config key 'algo.lrate'" in refused(capsys, "algo.lrate=1")
    assert "--nproc-per-node='x'" in refused(capsys, "--nproc-per-node", "x")
    assert "lacks verl's columns ['data_source', 'prompt', 'reward_model']" in refused(capsys, *data(d, "cols.parquet"))
    assert "row 1: prompt is neither" in refused(capsys, *data(d, "noprompt.jsonl"))
    assert "does not parse as parquet" in refused(capsys, *data(d, "bad.parquet"))
    assert "does not exist" in refused(capsys, *data(d, "none.parquet"))
    gsm = data(d, "gsm.parquet")
    assert "train row 0 (data_source 'openai/gsm8k'): the prompt is" in refused(capsys, *gsm,
                                                                                "data.max_prompt_length=8")
    assert "every one of the 1 train prompts is longer" in refused(capsys, *gsm, "data.max_prompt_length=8",
                                                                   "data.filter_overlong_prompts=true")
    assert "no such file" in refused(capsys, *gsm, f"reward.path={d / 'nope.py'}")
    assert "has no function reward.name='missing'" in refused(capsys, *gsm, f"reward.path={d / 'rewards.py'}",
                                                              "reward.name=missing")
    assert "does not take verl's arguments" in refused(capsys, *gsm, f"reward.path={d / 'rewards.py'}",
                                                       "reward.name=two_args")


def test_reward_calls_refused_before_any_rank(files, capsys):
    d = files
    gsm = data(d, "gsm.parquet")
    for name, text in (("raises", "KeyError: 'boom'"), ("none", "returned NoneType None"),
                       ("nan", "returned nan, not a finite number"), ("hangs", "no result within reward.timeout_s=3")):
        err = refused(capsys, *gsm, f"reward.path={d / 'rewards.py'}", f"reward.name={name}", "reward.timeout_s=3")
        assert "on data_source 'openai/gsm8k' row 0: " + text in err, err
    err = refused(capsys, *data(d, "unknown.parquet"))
    assert "verl's default_compute_score) on data_source 'my/task' row 0: NotImplementedError" in err


def test_console_script_one_line(files):
    """As a user runs it (its own process): one line, status 2, no traceback from any process."""
    from moe_lora_rl.cli import console

    assert console(["bogus"]) == 2
    p = subprocess.run([sys.executable, "-m", "moe_lora_rl.cli", "train", "data.bogus=1"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert "unknown config key 'data.bogus'" in p.stderr and "Traceback" not in p.stderr
