"""The main job's data and reward path (data/dataset.py, data/rewards.py, moe_lora_rl.data): verl's row format from
parquet and JSONL for any task, rewards with verl's signature in worker processes, and every bad input refused in
one line naming the file, the column, the row or the function. The reward checks share one spawned worker pool."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moe_lora_rl.data.dataset import Example, examples_from_rows, load_examples, read_rows, write_rows
from moe_lora_rl.data.rewards import RewardWorkers, check_result, load_function

pytest.importorskip("pyarrow")

GSM = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "Ann has 2 apples and buys 3. How many?"}],
       "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"},
       "extra_info": {"split": "train", "index": 0, "answer": "2 + 3 = 5\n#### 5"}}


def one_line(e) -> str:
    s = str(e.value)
    assert "\n" not in s, s
    return s


def test_rows_any_task_parquet_and_jsonl(tmp_path):
    """Chat or string prompts, ground truths of any JSON type, extra_info handed on unchanged; the same Examples
    from parquet and from JSONL."""
    rows = [GSM, {**GSM, "prompt": "What is 7 * 6?", "reward_model": {"ground_truth": 42}, "data_source": "mine"},
            {**GSM, "reward_model": {"ground_truth": [1, 2, 3]}, "extra_info": {"k": {"deep": [1]}}},
            {**GSM, "reward_model": {"ground_truth": 2.5}}]
    rows[3] = {k: v for k, v in rows[3].items() if k != "extra_info"}         # optional, as in verl
    pq_ex = load_examples(write_rows(rows[:1], tmp_path / "a.parquet"))
    js = tmp_path / "b.jsonl"
    js.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ex = load_examples(str(js), reference_key=None)
    assert [e.ground_truth for e in ex] == ["5", 42, (1, 2, 3), 2.5]
    assert ex[1].messages == [{"role": "user", "content": "What is 7 * 6?"}] and ex[1].data_source == "mine"
    assert ex[2].extra_info == {"k": {"deep": [1]}} and ex[3].extra_info == {}
    assert pq_ex[0] == ex[0] and pq_ex[0].extra_info == ex[0].extra_info
    both = load_examples([str(tmp_path / "a.parquet"), str(js)])
    assert [e.index for e in both] == [0, 1, 2, 3, 4]
    assert load_examples(tmp_path / "a.parquet", reference_key="extra_info.answer")[0].reference == GSM[
        "extra_info"]["answer"]


def test_bad_files_one_line(tmp_path):
    missing = write_rows([{"question": "x", "answer": "y"}], tmp_path / "m.parquet")
    with pytest.raises(ValueError) as e:
        read_rows(missing)
    assert "lacks verl's columns ['data_source', 'prompt', 'reward_model']" in one_line(e)
    js = tmp_path / "r.jsonl"
    js.write_text(json.dumps(GSM) + "\n" + json.dumps({**GSM, "prompt": []}) + "\n")
    with pytest.raises(ValueError) as e:
        read_rows(js)
    assert "row 1: prompt is neither" in one_line(e)
    js.write_text(json.dumps(GSM) + "\n" + json.dumps({**GSM, "reward_model": {"style": "rule"}}) + "\n")
    with pytest.raises(ValueError) as e:
        read_rows(js)
    assert "row 1: no reward_model.ground_truth" in one_line(e)
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"PAR1 not parquet")
    with pytest.raises(ValueError) as e:
        read_rows(bad)
    assert "does not parse as parquet" in one_line(e)
    with pytest.raises(ValueError) as e:
        read_rows(tmp_path / "none.jsonl")
    assert "does not exist" in one_line(e)
    with pytest.raises(ValueError) as e:
        examples_from_rows([GSM], reference_key="extra_info.solution", where="f")
    assert "f row 0: data.reference_key='extra_info.solution'" in one_line(e)


def test_prompt_length_verl_semantics(tmp_path):
    from moe_lora_rl.data.prompting import fit_prompt

    ids = list(range(10))
    assert fit_prompt(ids, 4, "left", "r") == [6, 7, 8, 9] and fit_prompt(ids, 4, "right", "r") == [0, 1, 2, 3]
    assert fit_prompt(ids, 4, "middle", "r") == [0, 1, 8, 9] and fit_prompt(ids, 10, "error", "r") == ids
    with pytest.raises(ValueError) as e:
        fit_prompt(ids, 4, "error", "data row 7 (data_source 'x')")
    assert "data row 7" in one_line(e) and "over data.max_prompt_length=4" in str(e.value)


def test_filter_overlong_prompts(tmp_path):
    """data.filter_overlong_prompts leaves out the long rows (counted) and refuses a dataset where none remain."""
    from moe_lora_rl.models import get_model
    from moe_lora_rl.rl import config as C
    from moe_lora_rl.rl.inputs import load_problems
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(get_model("glm4_moe", "tiny"))
    rows = [GSM, {**GSM, "prompt": [{"role": "user", "content": "word " * 200}]}]
    f = write_rows(rows, tmp_path / "d.parquet")
    base = [f"data.train_files={f}", f"data.val_files={f}", "data.filter_overlong_prompts=true"]
    train, held, dropped = load_problems(C.load(base + ["data.max_prompt_length=64"]), tok, "chat")
    assert [e.index for e in train] == [0] and dropped == {"train": 1, "val": 1}
    with pytest.raises(ValueError) as e:
        load_problems(C.load(base + ["data.max_prompt_length=8"]), tok, "chat")
    assert "every one of the 2 train prompts is longer than data.max_prompt_length=8" in one_line(e)


def test_resume_continues_mid_epoch(tmp_path):
    """A resumed run's next batch (a fresh process: caches cleared, the file read again) is the uninterrupted
    run's, in the middle of an epoch and across the epoch boundary; each epoch shows every row once; another seed
    (the negative control) draws another order."""
    from moe_lora_rl.rl import schedule
    from moe_lora_rl.rl.groups import group_plan

    f = write_rows([{**GSM, "reward_model": {"ground_truth": str(i)}} for i in range(10)], tmp_path / "d.parquet")

    def batches(examples, steps, seed=3):
        return [[examples[group_plan(len(examples), 4, 2, seed, s * 4 + i).problem].ground_truth for i in range(4)]
                for s in steps]

    run = batches(load_examples(f), range(6))
    assert sorted(sum(run[:5], [])[:10]) == sorted(sum(run[:5], [])[10:20]) == [str(i) for i in range(10)]
    schedule._epoch_order.cache_clear()
    for k in (1, 2, 3):                                   # resume after k steps: step 2 crosses into epoch 2
        assert batches(load_examples(f), [k]) == [run[k]]
    assert batches(load_examples(f), range(6), seed=4) != run


def test_reward_result_checks():
    assert check_result(1, "s", 0, "w") == (1.0, {})
    assert check_result({"score": 0.5, "acc": True, "n": 3, "pred": "x"}, "s", 0, "w") == (0.5, {"n": 3.0})
    for bad, text in ((None, "NoneType None, not a number"), (float("nan"), "nan, not a finite"),
                      ("1", "str '1', not a number"), ({"acc": 1}, "a dict without 'score'")):
        with pytest.raises(ValueError) as e:
            check_result(bad, "openai/gsm8k", 12, "w")
        assert "data_source 'openai/gsm8k' row 12" in one_line(e) and text in str(e.value), str(e.value)


from reward_files import REWARDS  # noqa: E402  (tests/unit: one reward file for these tests)


@pytest.fixture(scope="module")
def pool():
    from moe_lora_rl.data.rewards import BUILTIN, DEFAULT, make_pool

    p = make_pool([DEFAULT, next(iter(BUILTIN.values()))])      # verl's import is not a call's time
    yield p
    p.terminate()
    p.join()


def test_rewards_in_workers(tmp_path, pool):
    """verl's default scorer (gsm8k's strict "####" answer), a built-in task's source scored by its own scorer, a
    user's file with a dict result (its extra keys returned), and each bad reward refused in one line naming the
    data source and the row: raises, None, NaN, an unknown data_source (verl's NotImplementedError)."""
    from moe_lora_rl.data.dataset import task_rows
    from moe_lora_rl.data.task import TaskSpec

    gsm = examples_from_rows([GSM])[0]
    sort = examples_from_rows(task_rows(TaskSpec(n_eval=8), "eval")[:1])[0]
    default = RewardWorkers(None, pool=pool)
    scores, extras = default.score([(gsm, "2 + 3 = 5\n#### 5"), (gsm, "#### 6"), (gsm, "5"),
                                    (sort, sort.ground_truth), (sort, "1 2")])
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0] and extras == [{}] * 5
    unknown = Example("q", "1", "my/unknown_source", 4)
    with pytest.raises(ValueError) as e:
        default.probe([gsm, unknown])
    assert "data_source 'my/unknown_source' row 4: NotImplementedError" in one_line(e)

    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    scores, extras = RewardWorkers(str(f), "good", pool=pool).score([(gsm, "5"), (gsm, "four")])
    assert scores == [1.0, 0.0] and extras == [{"length": 1.0}, {"length": 4.0}]
    for name, text in (("raises", "KeyError: 'boom'"), ("none", "returned NoneType None, not a number"),
                       ("nan", "returned nan, not a finite number")):
        with pytest.raises(ValueError) as e:
            RewardWorkers(str(f), name, pool=pool).score([(gsm, "5")])
        assert f"reward (reward.path='{f}' reward.name='{name}') on data_source 'openai/gsm8k' row 0: {text}" \
            in one_line(e), str(e.value)


def test_same_scores_as_verls_reward_manager(tmp_path, pool):
    """The same responses (token ids, an EOS at the end) to gsm8k-format rows get the same scores through our path
    (rl/producer.py's decode, data/rewards.py's workers) and through verl 0.9.1's own: load_reward_manager (its
    custom_reward_function loading, else default_compute_score) and the reward loop's NaiveRewardManager.run_single
    on a DataProto as main_ppo builds it. With verl's default (gsm8k's strict "####"), the verl recipe's default
    (data/rewards.compute_score) and a reward file; control: another function of the file gives other scores. (verl
    adds num_turns and rollout_reward_scores to extra_info; ours hands the row's extra_info as it is.)"""
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    from moe_lora_rl.models import get_model
    from moe_lora_rl.rl.producer import Producer

    tok = AutoTokenizer.from_pretrained(get_model("glm4_moe", "tiny"))
    rows = [GSM, {**GSM, "reward_model": {"style": "rule", "ground_truth": "12"},
                  "extra_info": {"split": "test", "index": 7}}]
    examples = examples_from_rows(rows)
    texts = ["2 + 3 = 5\n#### 5", "#### 6", "5", "The answer is 5.", "3 * 4 = 12 #### 12", "#### 120", "12", ""]
    pairs = [(examples[i // 4], t) for i, t in enumerate(texts)]
    responses = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)

    def ours(path, name):
        cfg = SimpleNamespace(reward=SimpleNamespace(path=path, name=name, timeout_s=30.0, workers=1))
        prod = Producer(cfg, tok, "unused", [], [], tmp_path)
        prod.rewarder = RewardWorkers(path, name, pool=pool)
        return prod.score([SimpleNamespace(response=r) for r in responses], [ex for ex, _ in pairs])[0]

    def verls(path, name):
        config = OmegaConf.create({"reward": {
            "custom_reward_function": {"path": path, "name": name},
            "reward_manager": {"source": "register", "name": "naive", "module": {"path": None, "name": "x"}}}})
        manager = load_reward_manager(config, tok)
        prompt = tok.encode("question", add_special_tokens=False)
        scores = []
        for (ex, _), resp in zip(pairs, responses):
            row = rows[examples.index(ex)]
            width = max(map(len, responses)) + 1                          # right-padded as verl's rollout pads
            ids = resp + [tok.pad_token_id or 0] * (width - len(resp))
            mask = [1] * (len(prompt) + len(resp)) + [0] * (width - len(resp))
            data = DataProto.from_dict(
                tensors={"prompts": torch.tensor([prompt]), "responses": torch.tensor([ids]),
                         "attention_mask": torch.tensor([mask])},
                non_tensors={k: np.array([row[k]], dtype=object) for k in ("data_source", "reward_model",
                                                                           "extra_info")})
            scores.append(float(manager.loop.run_until_complete(manager.run_single(data))["reward_score"]))
        return scores

    default = ours(None, "compute_score")
    assert default == verls(None, "compute_score") == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    # the verl recipe's default reward (run_cpu_smoke.sh): our default's dispatch as verl's custom_reward_function
    assert verls("pkg://moe_lora_rl.data.rewards", "compute_score") == default
    custom = ours(str(f), "good")
    assert custom == verls(str(f), "good") and custom != default         # the file's function, not verl's default
    assert verls(str(f), "lenient") != custom                             # control: another name, other scores
    assert ours(str(f), "lenient") == verls(str(f), "lenient")


def test_reward_loading_refusals(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    assert load_function(str(f), "good")("s", "5", "5") == {"score": 1.0, "length": 1}
    assert load_function("pkg://moe_lora_rl.data.reward", "compute_score") is not None
    for path, name, text in ((str(tmp_path / "nope.py"), "good", "no such file"),
                             ("pkg://no_such_module_x", "f", "does not import: ModuleNotFoundError"),
                             (str(f), "missing", "has no function reward.name='missing'"),
                             (str(f), "NOT_A_FUNCTION", "is a int, not a function"),
                             (str(f), "two_args", "does not take verl's arguments")):
        with pytest.raises(ValueError) as e:
            load_function(path, name)
        assert text in one_line(e), str(e.value)


def test_reward_that_hangs_stops_at_its_timeout(tmp_path):
    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    w = RewardWorkers(str(f), "hangs", timeout_s=2)
    gsm = examples_from_rows([GSM])[0]
    with pytest.raises(ValueError) as e:
        w.score([(gsm, "5")])
    assert "row 0: no result within reward.timeout_s=2" in one_line(e) and w._pool is None   # its worker killed


def test_dropped_call_that_hangs_is_terminated(tmp_path):
    """A dropped call (its sample never scored) that keeps running holds the pool's one worker: the pool is
    terminated (the worker killed) and replaced, the live calls started again, at the next collect past the
    timeout or at the first submit after it. Control: a call forgotten without drop() leaves the worker busy and the
    next row is blamed for the hang."""
    import os
    import time

    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    gsm = examples_from_rows([GSM])[0]
    nxt = Example("q", "5", "openai/gsm8k", 7)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    w = RewardWorkers(str(f), "hangs_on_wait", timeout_s=2)
    first = int(w.score([(gsm, "4")])[1][0]["pid"])
    w.drop(w.submit([(gsm, "wait")]))                  # at collect: the live call waits, then the pool goes
    scores, extras = w.score([(nxt, "5")])
    second = int(extras[0]["pid"])
    assert scores == [1.0] and w.replaced == 1 and second != first and not alive(first)
    w.drop(w.submit([(gsm, "wait")]))                  # at submit: dropped more than timeout_s ago
    time.sleep(2.2)
    handle = w.submit([(nxt, "5")])
    assert w.replaced == 2 and not alive(second)                 # replaced before this call started
    assert w.collect(handle)[0] == [1.0]
    w.close(kill=True)

    w = RewardWorkers(str(f), "hangs_on_wait", timeout_s=2)      # control: the handle forgotten, not dropped
    w.submit([(gsm, "wait")])
    with pytest.raises(ValueError) as e:
        w.score([(nxt, "5")])
    assert "row 7: no result within reward.timeout_s=2" in one_line(e) and w.replaced == 0


def test_data_cli_writes_verl_rows(tmp_path):
    from moe_lora_rl.data import write
    from moe_lora_rl.data.__main__ import main

    paths = write("gsm8k_arith", tmp_path, n_eval=16)
    val, train = load_examples(paths["val"], reference_key="extra_info.answer"), load_examples(paths["train"])
    assert len(val) == 16 and len(train) == 4000 and val[0].data_source == "openai/gsm8k"
    assert val[0].reference.endswith(f"#### {val[0].ground_truth}")
    assert not {e.messages[0]["content"] for e in val} & {e.messages[0]["content"] for e in train}   # held out
    easy = load_examples(write("gsm8k_add1", tmp_path / "a", fmt="jsonl")["val"], reference_key="extra_info.answer")
    assert len(easy) == 32 and all(" + " in e.reference and int(e.ground_truth) <= 18 for e in easy)
    with pytest.raises(ValueError, match="level 'add1' has 162 distinct problems; hold out at most 81"):
        write("gsm8k_add1", tmp_path / "b", n_eval=100)
    paths = write("sort", tmp_path / "s", fmt="jsonl", n_eval=8)
    assert load_examples(paths["val"])[0].data_source == "moe_lora_rl/addition"
    assert main(["nope", str(tmp_path)]) == 2


def test_per_source_figures(tmp_path):
    """A batch mixing sources: each source's mean reward beside the mean, the dict reward's extras averaged; one
    source: none (the control). The summary's by_source and the plot's lines read them."""
    from moe_lora_rl.rl.metrics import plot, reward_figures
    from moe_lora_rl.rl.summary import by_source

    f = reward_figures([1.0, 0.0, 0.5, 0.5], [{"n": 2.0}, {}, {"n": 4.0}, {}], ["a", "a", "b", "b"])
    assert f == {"reward_extra/n": 3.0, "reward/a": 0.5, "reward/b": 0.5}
    assert reward_figures([1.0, 0.0], [{}, {}], ["a", "a"]) == {}
    hist = [{"reward": 0.5, "reward/a": 0.2, "reward/b": 0.8}, {"reward": 0.6, "reward/a": 0.4, "reward/b": 0.8,
                                                               "eval": 0.3, "eval/a": 0.1, "eval/b": 0.5}]

    def mean(key, rows):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    got = by_source(hist, {"eval/a": 0.05, "eval/b": 0.4}, mean, 1)["by_source"]
    assert got["a"] == {"reward_start": 0.2, "reward_end": 0.4, "eval_start": 0.05, "eval_end": 0.1}
    assert by_source([{"reward": 1.0}], {}, mean, 1) == {}
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("".join(json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(hist)))
    assert plot(jsonl, tmp_path / "m.png").stat().st_size > 10_000
