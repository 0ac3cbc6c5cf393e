"""Warm start: the supervised batch masks everything but the answer, and training is deterministic from the seed."""
import dataclasses

import pytest
import torch

from moe_lora_rl.rl.task import Problem, TaskSpec
from moe_lora_rl.rl.warm_start import WarmStartSpec, sft_batch, train


@pytest.fixture(scope="module")
def tiny():
    import transformers

    from moe_lora_rl.models import get_model

    path = get_model("glm4_moe", "tiny")
    return path, transformers.AutoTokenizer.from_pretrained(path)


def test_sft_batch_labels_only_the_answer(tiny):
    _, tok = tiny
    ids, mask, labels = sft_batch(tok, [Problem((3, 1, 4, 1, 5), 0), Problem((9, 2, 6, 5, 3), 1)])
    for i, ans in enumerate(["1 1 3 4 5", "2 3 5 6 9"]):
        kept = labels[i][labels[i] != -100].tolist()
        assert tok.decode(kept) == ans + "<|im_end|>"
        n = int(mask[i].sum())
        assert (labels[i, :n] != -100).sum() == len(kept) and (labels[i, n:] == -100).all()
        assert ids[i, n - len(kept):n].tolist() == kept        # the answer closes the sequence


def _weights_after(path, tok, spec):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.set_num_threads(1)
    info = train(model, tok, spec)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), info


def test_train_deterministic_from_seed(tiny):
    path, tok = tiny
    spec = WarmStartSpec(task=TaskSpec(length=5, n_eval=64), steps=3, batch_size=4)
    w1, info = _weights_after(path, tok, spec)
    w2, _ = _weights_after(path, tok, spec)
    assert torch.equal(w1, w2) and info["steps"] == 3 and info["final_loss"] > 0
    w3, _ = _weights_after(path, tok, dataclasses.replace(spec, seed=1))
    assert not torch.equal(w1, w3)                              # negative control: another seed, other batches


def test_spec_validation():
    with pytest.raises(ValueError, match="steps=0"):
        WarmStartSpec(steps=0)
    assert WarmStartSpec().key() != WarmStartSpec(steps=401).key()
