"""Samples packed into one row (positions restarting, megatron/forward.packed_inputs) are refused on a hybrid
linear-attention model: a block-diagonal mask separates them in attention only, the delta-net's state would run from
one sample into the next (the replay bench measured packed logits 27 off HF's per sample before the check)."""
from types import SimpleNamespace

import pytest
import torch

from moe_lora_rl.megatron.forward import packed_inputs, refuse_packed_on_hybrid

HYBRID = SimpleNamespace(experimental_attention_variant="gated_delta_net")
ATTENTION_ONLY = SimpleNamespace(experimental_attention_variant=None)


def test_packed_rows_refused_on_the_hybrid_only():
    pos, _ = packed_inputs([5, 3, 4])
    with pytest.raises(ValueError, match="packed samples .* on a hybrid linear-attention model"):
        refuse_packed_on_hybrid(HYBRID, pos)
    refuse_packed_on_hybrid(ATTENTION_ONLY, pos)                        # attention: the mask separates samples
    padded = torch.arange(12).unsqueeze(0).expand(2, 12)
    refuse_packed_on_hybrid(HYBRID, padded)                             # one sample per row: fine
    refuse_packed_on_hybrid(HYBRID, None)
