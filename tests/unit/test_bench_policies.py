"""bench policies refuses what it cannot honour before any run starts (in process: each refusal is a ValueError,
which the bench CLI prints as one line)."""
import pytest

from moe_lora_rl.bench import policies


@pytest.mark.parametrize("argv,match", [
    (["--seeds", "1"], "--seeds='1': expected two values"),
    (["--seeds", "1,1"], "the two policies would be the same run"),
    (["--lrs", "a,b"], "--lrs='a,b': expected two comma-separated floats"),
    (["--steps", "0"], "--steps=0"),
    (["--layouts", "tp1ep1pp1,tp2ep2"], "policies runs one layout, got 2"),
    (["--model", "/nonexistent"], "--model='/nonexistent' is not an HF checkpoint directory"),
    (["--", "policies=[{name: a}, {name: a}]"], "policies: name 'a' is given 2 times"),
])
def test_refusals(argv, match):
    with pytest.raises(ValueError, match=match):
        policies.main(argv)
