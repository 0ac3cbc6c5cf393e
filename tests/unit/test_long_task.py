"""The long-reasoning task (data.task=sort_long): the written selection sort, sizes from a skewed mix; its reward is
the final result the trace writes (the picks, one per line), the remainders beside them not graded; its refusals
are one line before anything starts."""

import pytest

from moe_lora_rl.rl import config
from moe_lora_rl.rl.config import preflight
from moe_lora_rl.data.reward import LONG_SOURCE, compute_score
from moe_lora_rl.data.task import MIXES, Problem, TaskSpec, make_split, parse_mix


@pytest.fixture(scope="module")
def tok():
    import transformers

    from moe_lora_rl.models import get_model

    return transformers.AutoTokenizer.from_pretrained(get_model("glm4_moe", "wide"))


def test_answer_is_the_trace():
    p = Problem((3, 1, 4, 1), 0, "sort_long")
    assert p.answer == " 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 |"
    assert p.question == "sort 3 1 4 1" and p.data_source == LONG_SOURCE


@pytest.mark.parametrize("response, score", [
    (" 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 |", 1.0),
    (" 1 | 3 4 1\n 1 | 3 4 4\n 3 | 9\n 4 |\n", 1.0),         # remainders are working: the picks are the result
    (" 1 | 3 4 1\n 3 | 4\n 4 |", 0.0),                        # a digit lost
    (" 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 | 4\n 4 |", 0.0),      # one too many
    (" 1 | 3 4 1\n 1 | 3 4\n 3 | 4", 0.0),                    # cut off
    (" 1 | 3 4 1\n 1 | 3 4\n 3 | 4\n 4 |\n= 1 1 3 4", 0.0),   # a line that is not a step
    (" 1 | 3 4 1\n 1 | 3 4\n 4 | 3\n 3 |", 0.0),              # out of order
    ("", 0.0)])
def test_reward_reads_the_result_off_the_trace(response, score):
    gt = Problem((3, 1, 4, 1), 0, "sort_long").answer
    assert compute_score(LONG_SOURCE, response, gt) == score


def test_splits_follow_the_mix_and_hold_out_multisets():
    spec = TaskSpec(kind="sort_long", n_eval=256)
    held, train = make_split(spec, "eval"), make_split(spec, "train")
    assert make_split(TaskSpec(kind="sort_long", n_eval=256, mix=MIXES["long"]), "eval") == held   # one split a mix
    assert len(held) == 256 and len(train) == 50_000 and make_split(spec, "eval") == held
    assert not {tuple(sorted(p.digits)) for p in held} & {tuple(sorted(p.digits)) for p in train[:5000]}
    sizes = sorted(len(p.digits) for p in train[:20000])
    assert (sizes[0], sizes[-1]) == (8, 25)
    assert abs(sum(s <= 13 for s in sizes) / len(sizes) - 0.7) < 0.02          # 70% short, 30% long
    assert sizes[len(sizes) // 2] in (11, 12, 13) and sizes[int(0.9 * len(sizes))] >= 19


def test_response_lengths_have_a_heavy_tail(tok):
    """Answer tokens (with the end of turn) of the held-out split: p50 >= 100, p90 >= 250, the longest near 400."""
    n = sorted(len(tok(p.answer, add_special_tokens=False)["input_ids"]) + 1
               for p in make_split(TaskSpec(kind="sort_long", n_eval=1024), "eval"))
    p10, p50, p90 = n[len(n) // 10], n[len(n) // 2], n[int(0.9 * len(n))]
    assert 55 <= p10 <= 100 and 100 <= p50 <= 160 and 250 <= p90 <= 360 and 380 <= n[-1] <= 400, (p10, p50, p90, n[-1])


def test_mix_parsing_and_refusals():
    assert parse_mix("long") == parse_mix(MIXES["long"]) == ((8, 13, 0.7), (14, 25, 0.3))
    assert parse_mix("2-4:1,5-5:3") == ((2, 4, 0.25), (5, 5, 0.75))
    for mix, needle in (("lognormal", "neither a name"), ("8-26:1", "8-26:1"), ("9-8:1", "9-8:1"),
                        ("8-12:0", "weight")):
        with pytest.raises(ValueError, match=needle):
            TaskSpec(kind="sort_long", mix=mix)
    with pytest.raises(ValueError, match="applies to kinds"):
        TaskSpec(kind="sort", mix="long")


def test_run_refusals():
    for overrides, needle in ((["data.task=sort_long", "data.mix=heavy"], "size mix 'heavy'"),
                              (["data.task=sort_longer"], "sort_longer"),
                              (["data.mix=long"], "applies to kinds")):
        with pytest.raises(ValueError, match=needle):
            config.load(overrides)
    assert config.split_config_name(["-cn", "long", "steps=3"]) == ("long", ["steps=3"])
    cfg = config.load([], config_name="long")
    assert (cfg.data.task, cfg.algo.max_response_tokens) == ("sort_long", 400)
    with pytest.raises(ValueError, match=r"algo.max_response_tokens=300 is below the longest answer of "
                                         r"data.task=sort_long \(400 tokens with the end of turn, 25 digits\)"):
        preflight.check(config.load(["algo.max_response_tokens=300"], config_name="long"), 2)
    with pytest.raises(ValueError, match=r"max_response_tokens=5 is below .* data.task=sort \(6 tokens"):
        preflight.check(config.load(["algo.max_response_tokens=5"]), 2)
    preflight.check(config.load([], config_name="long"), 2)


def test_cli_recipe_and_refusals(train_cli):
    for args, needle in ((["--config-name", "longest"], "no recipe recipes/longest.yaml"),
                         (["--config-name=long", "algo.max_response_tokens=100"], "max_response_tokens=100")):
        rc, lines, err = train_cli(*args)
        assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err