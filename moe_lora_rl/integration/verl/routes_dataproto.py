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


def routes_from_verl(per_sample: list, lengths: list[int], *, num_layers: int, moe_layer_ids: list[int],
                     num_experts: int, topk: int) -> RoutesBatch:
    """verl's `routed_experts` (one [len_i or len_i-1, L, topk] int16 tensor per sample, the rows of the sample's
    real tokens after its left padding is removed) -> our RoutesBatch of [len_i - 1, moe layers, topk].

    The layer axis L is read as verl's set_router_replay_data reads it: all transformer layers indexed by global
    layer number (L == num_layers, rows of dense layers unused), or only the MoE layers in order (L == number of
    MoE layers). The last token's route is dropped: its logits predict nothing (verl's replay mask skips it too)."""
    import numpy as np

    if len(per_sample) != len(lengths):
        raise ValueError(f"routed_experts has {len(per_sample)} samples, the batch has {len(lengths)}")
    samples = []
    for i, (r, n) in enumerate(zip(per_sample, lengths)):
        r = np.asarray(r.cpu() if hasattr(r, "cpu") else r)
        if r.ndim != 3 or r.shape[2] != topk:
            raise ValueError(f"routed_experts sample {i} has shape {tuple(r.shape)}; expected [tokens, layers, "
                             f"top-k {topk}]")
        if r.shape[1] == num_layers:
            cols = list(moe_layer_ids)
        elif r.shape[1] == len(moe_layer_ids):
            cols = list(range(len(moe_layer_ids)))
        else:
            raise ValueError(f"routed_experts layer axis of {r.shape[1]} matches neither the model's {num_layers} "
                             f"layers nor its {len(moe_layer_ids)} MoE layers")
        if r.shape[0] not in (n, n - 1):
            raise ValueError(f"routed_experts sample {i} covers {r.shape[0]} tokens, the sample has {n}")
        samples.append(r[: n - 1][:, cols].astype(np.int64))
    return RoutesBatch(samples, tuple(moe_layer_ids), num_experts, topk)
