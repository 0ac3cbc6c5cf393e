"""What the default reward reads (data/rewards.compute_score: the main job's reward.path=null and the verl route's
pkg://moe_lora_rl.data.rewards): every built-in data source and every verl scorer it hands to, on a correct answer
followed by a tail (a 300-character cut paid it 0), with a second answer after it, and in other number formats.
CASES is docs/data.md's table: `old` is verl 0.9.1's default_compute_score (the default before), asserted too,
so each row where old != new is a case today's verl-only default fails."""
from __future__ import annotations

import pytest

T240 = " Let me check this again." * 9 + "." * 15
T400 = ("\nQuestion: Ben has 3 pens. How many pens does Ben have? Answer step by step. " * 6)[:400]
G = "openai/gsm8k"
CASES = [  # data source, case, response, ground truth, old score (verl's), new score (ours)
    (G, "answer alone", "2 + 40 = 42\n#### 42\n", "42", 1.0, 1.0),
    (G, "240-char tail", "2 + 40 = 42\n#### 42\n" + T240, "42", 1.0, 1.0),
    (G, "400-char tail", "2 + 40 = 42\n#### 42\n" + T400, "42", 0.0, 1.0),
    (G, "20,000-char tail", "2 + 40 = 42\n#### 42\n" + "x" * 20000, "42", 0.0, 1.0),
    (G, "tail with a 2nd answer", "#### 42\nQuestion: 10 + 7? #### 17", "42", 0.0, 1.0),
    (G, "wrong, then right", "#### 17\nNo: 2 + 40 = 42 #### 42", "42", 1.0, 0.0),
    (G, "1,234", "#### 1,234", "1234", 1.0, 1.0),
    (G, "42.0", "#### 42.0", "42", 0.0, 1.0),
    (G, "-7", "#### -7", "-7", 1.0, 1.0),
    (G, "$42", "#### $42", "42", 0.0, 1.0),
    (G, "42. (sentence end)", "#### 42.", "42", 0.0, 1.0),
    (G, "####42 (no space)", "####42", "42", 0.0, 1.0),
    (G, "1,23 (bad grouping)", "#### 1,23", "123", 1.0, 0.0),
    (G, "no ####", "The answer is 42.", "42", 0.0, 0.0),
    (G, "wrong answer", "#### 43", "42", 0.0, 0.0),
    ("math_dapo", "Answer: alone", "2 + 40 = 42\nAnswer: 42", "42", 1.0, 1.0),
    ("math_dapo", "Answer: + 400-char tail", "Answer: 42\n" + T400, "42", -1.0, 1.0),
    ("math_dapo", "boxed + 150-char tail", "\\boxed{42}" + "x" * 150, "42", -1.0, 1.0),
    ("math_dapo", "1,234", "Answer: 1,234", "1234", 1.0, 1.0),
    ("math_dapo", "42.0", "Answer: 42.0", "42", -1.0, 1.0),
    ("math_dapo", "-7", "Answer: -7", "-7", 1.0, 1.0),
    ("math_dapo", "$42$", "Answer: $42$", "42", 1.0, 1.0),
    ("math_dapo", "wrong answer", "Answer: 43", "42", -1.0, -1.0),
    ("aime2024", "Answer: + 400-char tail", "Answer: 42\n" + T400, "42", -1.0, 1.0),
    ("lighteval/MATH", "boxed + 400-char tail", "\\boxed{42}" + T400, "42", 1.0, 1.0),
    ("lighteval/MATH", "1,234", "\\boxed{1,234}", "1234", 0.0, 1.0),
    ("lighteval/MATH", "42.0", "\\boxed{42.0}", "42", 0.0, 1.0),
    ("lighteval/MATH", "-7", "\\boxed{-7}", "-7", 1.0, 1.0),
    ("lighteval/MATH", "\\$42", "\\boxed{\\$42}", "42", 1.0, 1.0),
    ("lighteval/MATH", "wrong answer", "\\boxed{43}", "42", 0.0, 0.0),
    ("numina_synthetic_math", "boxed + 400-char tail", "\\boxed{42}" + T400, "42", 1.0, 1.0),
    ("numina_synthetic_math", "1,234", "\\boxed{1,234}", "1234", 1.0, 1.0),
    ("numina_synthetic_math", "42.0", "\\boxed{42.0}", "42", 1.0, 1.0),
    ("numina_synthetic_math", "-7", "\\boxed{-7}", "-7", 1.0, 1.0),
    ("numina_synthetic_math", "\\$42", "\\boxed{\\$42}", "42", 1.0, 1.0),
    ("searchR1_nq", "answer + 400-char tail", "<answer>Paris</answer>" + T400, {"target": ["Paris"]}, 1.0, 1.0),
    ("moe_lora_rl/addition", "answer + 400-char tail", "1 2 3\n" + T400, "1 2 3", 1.0, 1.0),
    ("moe_lora_rl/addition", "answer, 2 spaces", "1  2 3", "1 2 3", 0.0, 0.0),
    ("moe_lora_rl/sort_trace", "trace + tail", " 1 | 3 2\n 2 | 3\n 3 |\nmore", " 1 | 3 2\n 2 | 3\n 3 |", 0.0, 0.0),
    ("moe_lora_rl/sort_long", "trace + tail", " 1 | 3 2\n 2 | 3\n 3 |\nmore", " 1 | 3 2\n 2 | 3\n 3 |", 0.0, 0.0),
]


def _score(value):
    return float(value["score"] if isinstance(value, dict) else value)


def _verls(source, response, truth):
    from verl.utils.reward_score import default_compute_score

    from moe_lora_rl.data.reward import compute_score as builtin

    if source.startswith("moe_lora_rl/"):       # the built-in tasks: their own scorer, before and after
        return builtin(source, response, truth)
    return default_compute_score(source, response, truth)


@pytest.mark.parametrize("source, case, response, truth, old, new", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_default_reward_reads_the_whole_response(source, case, response, truth, old, new):
    from moe_lora_rl.data.rewards import compute_score

    assert _score(compute_score(source, response, truth)) == new
    assert _score(_verls(source, response, truth)) == old          # what the default paid before (control)


def test_gsm8k_first_answer_and_refusal():
    from moe_lora_rl.integration.verl.reward_score import gsm8k_answer, gsm8k_score

    assert str(gsm8k_answer("#### 1,234.50 then #### 9")) == "1234.50" and gsm8k_answer("####") is None
    assert gsm8k_score("#### 42", 42) == 1.0 and gsm8k_score("#### 42", "1,234") == 0.0
    with pytest.raises(ValueError) as e:
        gsm8k_score("#### 42", "forty-two")
    assert "openai/gsm8k ground truth 'forty-two' is not a number" in str(e.value) and "\n" not in str(e.value)


def test_builtin_tasks_keep_their_scorer():
    """The default task's data source (sort: moe_lora_rl/addition) and the other built-in tasks' go to data/reward.py,
    not to the default: their scores on the task's own rows (right, wrong, right with a tail) are data/reward.py's."""
    from moe_lora_rl.data import reward
    from moe_lora_rl.data.dataset import task_rows
    from moe_lora_rl.data.rewards import BUILTIN, compute_score, function_keys
    from moe_lora_rl.data.task import TaskSpec

    assert function_keys(None, "compute_score", ["moe_lora_rl/addition"]) == [("pkg://moe_lora_rl.data.reward",
                                                                            "compute_score")]
    rows = task_rows(TaskSpec(n_eval=16), "eval")
    for row in rows:
        src, truth = row["data_source"], row["reward_model"]["ground_truth"]
        assert src in BUILTIN
        for text in (truth, truth + "\n" + T400, "9 9"):
            assert compute_score(src, text, truth) == reward.compute_score(src, text, truth)
    assert {compute_score(r["data_source"], r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"])
            for r in rows} == {1.0}


def test_docs_table_is_the_cases():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    for source, case, _, _, old, new in CASES:
        row = f"| `{source}` | {case} | {old:g} | {new:g} |"
        assert row in text, row
