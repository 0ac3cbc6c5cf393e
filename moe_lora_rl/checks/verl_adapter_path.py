"""Part of the verl engine launch (verl_worker.py): lora.adapter_path through verl's TrainingWorker at each layout,
against HF transformers + PEFT on the same adapter directory.

Adapters (written once, before the layouts):
  export       the main job's export (refit/export.stream_to_peft, as rl/run.py writes run/adapter) of the first
               layout's engine with random adapters: written sharded, loaded at every layout
  peft         PEFT's own save_pretrained (checks/peft_native.py: q/k/v, o, the routed experts in PEFT's fused form)
  perturbed    `peft` with one o_proj lora_B moved by N(0, 0.05^2) (the control)
Per layout and adapter: a fresh TrainingWorker with model.lora.adapter_path set (the engine loads it at initialize),
infer_batch's log-probs (temperature 0.7) vs the log-probs of PEFT's model on the same rows; the control is the
perturbed adapter's engine log-probs vs PEFT's on the unperturbed one.
"""
from __future__ import annotations

from pathlib import Path

import torch

NATIVE_LORA = {"rank": 4, "alpha": 8, "adapter_layout": "per_expert", "target_modules": ["attention", "experts"]}


def write_adapters(path: str, engine, arch, root: Path) -> dict[str, Path]:
    """Collective: the three adapter directories under ROOT (rank 0 writes PEFT's; every rank joins the export)."""
    import torch.distributed as dist

    from ..refit.export import stream_to_peft
    from .peft_native import perturbed_copy, write_peft_adapter

    dirs = {"export": root / "export", "peft": root / "peft", "perturbed": root / "perturbed"}
    stream_to_peft(engine.model, arch, dirs["export"], base_model=path)
    if dist.get_rank() == 0:
        write_peft_adapter(path, dirs["peft"], rank=NATIVE_LORA["rank"], alpha=NATIVE_LORA["alpha"], seed=3)
        perturbed_copy(dirs["peft"], dirs["perturbed"])
    dist.barrier()
    return dirs


def peft_logprobs(path: str, adapter: Path, b) -> torch.Tensor:
    """[N, R] response log-probs of HF transformers + PEFT (fp32, eager attention) on the batch's real rows."""
    from ..lora.peft_hf import peft_logits
    from .verl_data import real_tokens, response_logprobs

    seqs = real_tokens(b)
    tokens = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    return response_logprobs(peft_logits(path, adapter, tokens), seqs, b)


def engine_logprobs(path: str, layout_name: str, lora: dict, b, old, adv) -> torch.Tensor:
    """[N, R] infer_batch log-probs of a TrainingWorker whose engine loaded model.lora.adapter_path (all ranks)."""
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig
    from verl.workers.config.optimizer import OptimizerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.padding import no_padding_2_padding

    from ..integration.verl.verl_config import MoELoRAEngineConfig
    from ..megatron.layout import Layout
    from ..megatron.parallel import teardown
    from .verl_data import MICRO, N, verl_batch

    teardown()
    lay = Layout.parse(layout_name)
    ec = MoELoRAEngineConfig(tensor_model_parallel_size=lay.tp, expert_model_parallel_size=lay.ep,
                             expert_tensor_parallel_size=lay.etp, pipeline_model_parallel_size=lay.pp,
                             dtype="float32", device="cpu", use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO,
                             infer_micro_batch_size_per_gpu=MICRO)
    mc = HFModelConfig(path=path, lora=dict(lora), external_lib="moe_lora_rl.integration.verl")
    w = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=mc, engine_config=ec,
                                            optimizer_config=OptimizerConfig(lr=1e-3)))
    w.reset()
    assert w.engine.adapter_path == lora["adapter_path"] and w.engine.version == 0
    dp, dpr = w.engine.get_data_parallel_size(), w.engine.get_data_parallel_rank()
    rows = list(range(dpr * N // dp, (dpr + 1) * N // dp))
    td = verl_batch(b, old, adv, rows, routes=False)
    res = w.infer_batch(td)
    mine = no_padding_2_padding(tu.get(res, "log_probs"), td) if res is not None else None
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (dpr, mine if w.engine.is_mp_src_rank_with_outputs() else None))
    full = torch.zeros(N, b["R"])
    for r, v in got:
        if v is not None:
            full[r * N // dp:(r + 1) * N // dp] = v
    return full


def check(path: str, layouts: list[str], dirs: dict[str, Path], export_lora: dict, b, old, adv, base) -> dict:
    """Per layout: max |engine - PEFT| log-prob over response tokens for each adapter, and the control; "effect":
    each adapter's PEFT log-probs against BASE (the model without adapters), the size of what is matched."""
    mask = b["resp_mask"].bool()
    oracle = {k: peft_logprobs(path, dirs[k], b) for k in ("export", "peft")}
    out = {"effect": {k: float((v - base).abs()[mask].max()) for k, v in oracle.items()}}
    for name in layouts:
        r = {}
        for key, lora in (("export", export_lora), ("peft", NATIVE_LORA), ("perturbed", NATIVE_LORA)):
            got = engine_logprobs(path, name, {**lora, "adapter_path": str(dirs[key])}, b, old, adv)
            ref = oracle["peft" if key == "perturbed" else key]
            r[f"adapter_{key}_diff"] = float((got - ref).abs()[mask].max())
        out[name] = r
    return out
