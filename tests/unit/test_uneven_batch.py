"""checks/data.uneven_batch: the batch with an empty and an odd-loaded expert where the routers give one; where they
spread every batch tried (a user's own model in `bench lora --model`), the most uneven batch, said so ("empty": False),
not a traceback."""
import torch

from moe_lora_rl.checks.data import uneven_batch


class _Gate(torch.nn.Module):
    """An HF-style top-2 router: token t goes to experts route(t) (returns logits, scores, indices)."""

    def __init__(self, route):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 4))
        self.route = route

    def forward(self, ids):
        idx = self.route(ids.reshape(-1))
        return torch.zeros(idx.shape[0], 8), torch.ones(idx.shape), idx


class _Model(torch.nn.Module):
    def __init__(self, route):
        super().__init__()
        mlp = torch.nn.Module()
        mlp.gate, mlp.experts = _Gate(route), torch.nn.Module()
        layer = torch.nn.Module()
        layer.mlp = mlp
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])

    def forward(self, input_ids):
        return self.model.layers[0].mlp.gate(input_ids)


def test_routed_by_token_gives_an_empty_and_an_odd_expert():
    toks, why = uneven_batch(_Model(lambda t: torch.stack([t % 8, (t + 1) % 8], 1)), 3, 5, 64)
    assert why["empty"] and 0 in why["counts"] and any(c % 2 for c in why["counts"]), why
    assert toks.shape == (3, 5)


def test_spread_routers_get_the_most_uneven_batch_and_say_so():
    spread = lambda t: torch.stack([torch.arange(len(t)) % 8, (torch.arange(len(t)) + 4) % 8], 1)
    toks, why = uneven_batch(_Model(spread), 4, 4, 64, tries=5)         # 32 routes over 8 experts: 4 each, always
    assert not why["empty"] and why["counts"] == [4] * 8 and toks.shape == (4, 4), why
