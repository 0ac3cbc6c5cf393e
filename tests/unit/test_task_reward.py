"""The synthetic task: deterministic splits with no overlap, the scorer, the parquet rows in verl's format, and the
same file and scorer through verl's own RLHFDataset and reward manager (CPU)."""
import math

import pytest

from moe_lora_rl.data.dataset import examples_from_rows, read_rows, write_parquet
from moe_lora_rl.data.reward import DATA_SOURCE, compute_score, extract_answer
from moe_lora_rl.data.task import Problem, TaskSpec, make_split


def test_splits_deterministic_disjoint_and_complete():
    spec = TaskSpec(length=5, n_eval=256, seed=0)
    tr, ev = make_split(spec, "train"), make_split(spec, "eval")
    assert [p.digits for p in ev] == [p.digits for p in make_split(spec, "eval")]        # deterministic
    ms = lambda ps: {tuple(sorted(p.digits)) for p in ps}  # noqa: E731
    assert len(ev) == len(ms(ev)) == 256 and [p.index for p in ev] == list(range(256))
    assert not ms(tr) & ms(ev)                             # no held-out list, nor a permutation of one, in training
    assert len(ms(tr) | ms(ev)) == math.comb(9 + 5 - 1, 5)  # every multiset of five digits 1-9 is in one split
    assert len(tr) == len({p.digits for p in tr}) == 9 ** 5 - sum(_orderings(m) for m in ms(ev))
    other = make_split(TaskSpec(length=5, n_eval=256, seed=1), "eval")
    assert [p.digits for p in other] != [p.digits for p in ev]      # negative control: the seed matters
    assert all(set(p.digits) <= set(range(1, 10)) for p in tr + ev)


def _orderings(m):
    return math.factorial(len(m)) // math.prod(math.factorial(m.count(d)) for d in set(m))


def test_every_problem_tokenizes_to_the_same_length():
    from transformers import AutoTokenizer

    from moe_lora_rl.models import get_model
    from moe_lora_rl.data.hf_sampling import prompt_ids

    tok = AutoTokenizer.from_pretrained(get_model("glm4_moe", "tiny"))
    spec = TaskSpec(length=5, n_eval=64)
    problems = make_split(spec, "train")[:2000] + make_split(spec, "eval")
    assert {len(p) for p in prompt_ids(tok, problems)} == {23}           # <= 24 prompt tokens
    assert {len(tok(p.answer, add_special_tokens=False)["input_ids"]) for p in problems} == {5}
    # negative control: a zero digit would take two tokens (the BPE has no " 0")
    assert len(tok("1 0", add_special_tokens=False)["input_ids"]) == 3


def test_problem_text():
    p = Problem((3, 1, 4, 1, 5), 0)
    assert p.question == "sort 3 1 4 1 5" and p.answer == "1 1 3 4 5"


@pytest.mark.parametrize("response, score", [
    ("1 1 3 4 5", 1.0), (" 1 1 3 4 5 ", 1.0), ("1 1 3 4 5\nmore text", 1.0),
    ("11345", 0.0), ("1  1 3 4 5", 0.0), ("1 3 1 4 5", 0.0), ("1 1 3 4 5 5", 0.0), ("1 1 3 4", 0.0), ("", 0.0),
    ("sorted: 1 1 3 4 5", 0.0), ("1 1 3 4 5.", 0.0),
])
def test_compute_score(response, score):
    assert compute_score(DATA_SOURCE, response, "1 1 3 4 5", {"index": 0}) == score


def test_compute_score_wrong_source_and_extract():
    with pytest.raises(ValueError, match="data_source 'openai/gsm8k'"):
        compute_score("openai/gsm8k", "8 2", "8 2")
    assert extract_answer("1 9 8") == "1 9 8" and extract_answer("x") is None


def test_bad_spec():
    with pytest.raises(ValueError, match="length=9"):
        TaskSpec(length=9)
    with pytest.raises(ValueError, match="n_eval=400"):
        TaskSpec(length=5, n_eval=400)
    with pytest.raises(ValueError, match="split 'test'"):
        make_split(TaskSpec(), "test")


def test_parquet_rows_roundtrip(tmp_path):
    pytest.importorskip("pyarrow")
    spec = TaskSpec(length=5, n_eval=64)
    path = write_parquet(spec, "eval", tmp_path / "eval.parquet")
    rows = read_rows(path)
    assert len(rows) == 64
    r = rows[3]
    p = make_split(spec, "eval")[3]
    assert r["data_source"] == DATA_SOURCE and r["prompt"] == [{"role": "user", "content": p.question}]
    assert r["reward_model"] == {"style": "rule", "ground_truth": p.answer}
    assert r["extra_info"]["index"] == 3 and r["extra_info"]["split"] == "eval"
    assert r["extra_info"]["digits"] == list(p.digits)
    ex = examples_from_rows(rows)
    assert [(e.messages, e.ground_truth, e.data_source, e.index) for e in ex] == \
        [(p.messages, p.answer, p.data_source, p.index) for p in make_split(spec, "eval")]


def test_unparsable_dataset_is_one_line_error(tmp_path):
    pytest.importorskip("pyarrow")
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError) as e:
        read_rows(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), other)
    with pytest.raises(ValueError, match=r"lacks verl's columns \['data_source', 'prompt', 'reward_model'\]"):
        read_rows(other)


def test_verl_rlhf_dataset_and_reward_manager(tmp_path):
    """The parquet through verl's RLHFDataset (chat template, lengths) and our scorer through verl's reward loader
    (custom_reward_function) and its naive reward manager, on a tokenized (prompt, response) batch."""
    pytest.importorskip("verl")
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from moe_lora_rl.models import get_model

    tok = AutoTokenizer.from_pretrained(get_model("glm4_moe", "tiny"))
    spec = TaskSpec(length=5, n_eval=32)
    path = write_parquet(spec, "eval", tmp_path / "eval.parquet")
    ds = RLHFDataset(str(path), tok, OmegaConf.create({"max_prompt_length": 24, "filter_overlong_prompts": True,
                                                       "cache_dir": str(tmp_path / "cache"),
                                                       "filter_overlong_prompts_workers": 1}))
    assert len(ds) == 32                                    # every prompt fits in 24 tokens (none filtered)
    item = ds[5]
    problems = make_split(spec, "eval")
    assert item["raw_prompt"] == [{"role": "user", "content": problems[5].question}] and item["index"] == 5
    assert item["reward_model"]["ground_truth"] == problems[5].answer

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"path": "pkg://moe_lora_rl.data.reward",
                                                                  "name": "compute_score", "reward_kwargs": {}},
                                       "reward_manager": {"source": "register", "name": "naive"}}})
    mgr = load_reward_manager(cfg, tok)
    responses = [problems[0].answer, problems[1].question[5:], problems[2].answer + "\nx", "nonsense"]
    expect = [1.0, float(problems[1].question[5:] == problems[1].answer), 1.0, 0.0]    # unsorted copy: 0
    scores = []
    for i, text in enumerate(responses):
        row = ds[i]
        p_ids = tok.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=True)
        p_ids = list(p_ids["input_ids"] if hasattr(p_ids, "keys") else p_ids)
        r_ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        data = DataProto.from_dict(
            tensors={"prompts": torch.tensor([p_ids]), "responses": torch.tensor([r_ids]),
                     "attention_mask": torch.ones(1, len(p_ids) + len(r_ids), dtype=torch.long)},
            non_tensors={"data_source": [row["data_source"]], "reward_model": [row["reward_model"]],
                         "extra_info": [row["extra_info"]]})
        out = mgr.loop.run_until_complete(mgr.run_single(data))
        scores.append(out["reward_score"])
    assert scores == expect
