"""verl's reward route with a reward that returns NaN: our FiniteRewardManager (verl's naive manager, one check after
each score) refuses it in one line naming the data source and the row, where verl's naive manager passes it on (the
control: its score is NaN, which makes the group's GRPO advantages NaN and the step skipped). A finite score is the
naive manager's, unchanged."""
import asyncio
import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl


def _item(data_source="openai/gsm8k", index=7):
    from verl import DataProto

    prompts = torch.tensor([[5, 6, 7]])
    responses = torch.tensor([[8, 9, 0]])
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])},
        non_tensors={"data_source": np.array([data_source], dtype=object),
                     "reward_model": np.array([{"ground_truth": "42"}], dtype=object),
                     "extra_info": np.array([{"index": index}], dtype=object)})


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _score(cls, value):
    mgr = cls(config=None, tokenizer=_Tok(), compute_score=lambda **kw: value)
    return asyncio.get_event_loop().run_until_complete(mgr.run_single(_item()))["reward_score"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), {"score": float("nan")}])
def test_a_non_finite_reward_is_refused_naming_source_and_row(bad):
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from moe_lora_rl.integration.verl.reward_manager import FiniteRewardManager

    naive = _score(NaiveRewardManager, bad)                      # control: verl passes it on
    assert not math.isfinite(naive)
    with pytest.raises(ValueError, match=r"reward of data source 'openai/gsm8k', row 7: .* is not a finite number") \
            as e:
        _score(FiniteRewardManager, bad)
    assert "\n" not in str(e.value)


def test_a_finite_reward_is_the_naive_managers():
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from moe_lora_rl.integration.verl.reward_manager import FiniteRewardManager

    for v in (0.0, 1.0, -0.5, {"score": 0.25, "acc": 1.0}):
        assert _score(FiniteRewardManager, v) == _score(NaiveRewardManager, v)


def test_verls_plain_naive_manager_is_refused_up_front():
    from omegaconf import OmegaConf

    from moe_lora_rl.integration.verl.verl_config import check_reward_manager

    with pytest.raises(ValueError, match=r"reward.reward_manager.name=naive passes NaN rewards"):
        check_reward_manager(OmegaConf.create({"reward": {"reward_manager": {"source": "register", "name": "naive"}}}))
    check_reward_manager(OmegaConf.create({"reward": {"reward_manager": {
        "source": "importlib", "name": "FiniteRewardManager",
        "module": {"path": "pkg://moe_lora_rl.integration.verl.reward_manager"}}}}))
