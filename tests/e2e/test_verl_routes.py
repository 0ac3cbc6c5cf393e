"""Routes travel in a verl DataProto (through its own concat/split) and come back unchanged."""
import numpy as np
import pytest

pytestmark = pytest.mark.verl


def test_routes_roundtrip_through_dataproto():
    import torch
    from verl import DataProto

    from moe_lora_rl.integration.verl.routes_dataproto import attach_routes, routes_from
    from moe_lora_rl.router_replay.routes import RoutesBatch

    rng = np.random.default_rng(0)
    routes = RoutesBatch([rng.integers(0, 16, (n, 3, 4)) for n in (5, 9, 7, 2)], (1, 2, 3), 16, 4)
    data = DataProto.from_dict(tensors={"input_ids": torch.zeros(4, 9, dtype=torch.long)})
    attach_routes(data, routes)
    halves = data.chunk(2)
    back = routes_from(DataProto.concat(halves))
    assert back.layer_ids == (1, 2, 3) and back.num_experts == 16 and back.topk == 4
    assert all(np.array_equal(a, b) for a, b in zip(routes.samples, back.samples))
    with pytest.raises(ValueError, match="routes for 4 samples, DataProto has 2"):
        attach_routes(halves[0], routes)
