"""RoutesBatch <-> verl DataProto: per-sample tensors go into the batch (leading dim = batch), the layer numbers,
expert count and top-k into meta_info."""
from __future__ import annotations

from ...router_replay.routes import RoutesBatch

META = "moe_lora_rl.routes"


def attach_routes(data, routes: RoutesBatch) -> None:
    """Add the routes to a DataProto in place (batch keys routed_experts, routed_experts_len)."""
    if len(data) != len(routes.samples):
        raise ValueError(f"routes for {len(routes.samples)} samples, DataProto has {len(data)}")
    field = routes.to_field()
    data.batch["routed_experts"] = field["routed_experts"]
    data.batch["routed_experts_len"] = field["routed_experts_len"]
    data.meta_info[META] = {"layer_ids": list(routes.layer_ids), "num_experts": routes.num_experts,
                            "topk": routes.topk}


def routes_from(data) -> RoutesBatch:
    if "routed_experts" not in data.batch.keys() or META not in data.meta_info:
        raise ValueError("DataProto carries no routes (routed_experts / meta_info['moe_lora_rl.routes'])")
    meta = data.meta_info[META]
    import torch

    return RoutesBatch.from_field({"routed_experts": data.batch["routed_experts"],
                                   "routed_experts_len": data.batch["routed_experts_len"],
                                   "routed_experts_layers": torch.tensor(meta["layer_ids"])}, meta["num_experts"])
