"""torchrun worker: R3 in Megatron at each layout, against a rollout and the forced-route reference.

Per layout and model:
  rollout metrics (full-length samples, padded and packed): router disagreement without replay, k3 KL to the
      rollout logprobs without and with R3;
  fidelity (the forced sets of replay.py, samples of different lengths, padded and packed): max |logit diff|
      between Megatron replaying a set and HF transformers forced to it (rollout and random sets), and between
      Megatron replaying the shuffled set and the reference of the rollout set (must differ); the same relative
      per token (max_v |diff| / max_v |reference logit|, the worst token), the bf16 metric;
  dispatcher: the routing map every MoE layer's token dispatcher received vs the rollout-format routes of the tokens
      this rank holds (rollout and random sets, padding included), counted in mismatching tokens.
Every queued route is consumed exactly once (check_consumed). Rank 0 writes JSON.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..megatron.forward import forward_logits, has_delta_net, packed_inputs
from ..policy.model import build_from_hf
from ..router_replay.align import align_microbatch
from ..mismatch import k3_kl
from ..router_replay.disagreement import router_disagreement
from ..router_replay.replayer import Mode, RouterReplayer
from ..router_replay.routes import RoutesBatch
from .dispatch_capture import capture_routing_maps, expected_rows, map_to_ids
from .torchrun import each_model_at_layout, finish_worker, worker_args


def _inputs(tokens: list[torch.Tensor], padded_len: int | None):
    """(token tensor, forward kwargs) for a padded [b, padded_len] or packed [1, sum] batch."""
    if padded_len is None:
        pos, mask = packed_inputs([len(t) for t in tokens])
        return torch.cat(tokens)[None], {"position_ids": pos, "attention_mask": mask}
    out = torch.zeros(len(tokens), padded_len, dtype=torch.long)
    for b, t in enumerate(tokens):
        out[b, :len(t)] = t
    return out, {}


def _per_sample(logits: torch.Tensor, lengths: list[int], packed: bool) -> list[torch.Tensor]:
    if not packed:
        return [logits[b, :n] for b, n in enumerate(lengths)]
    starts = np.cumsum([0] + lengths[:-1])
    return [logits[0, s:s + n] for s, n in zip(starts, lengths)]


def _k3(logits, lengths, packed, ref_lp, tokens) -> tuple[float, int]:
    total, cnt = 0.0, 0
    for seg, lp, tok in zip(_per_sample(logits, lengths, packed), ref_lp, tokens):
        got = torch.log_softmax(seg.double(), -1)[:-1].gather(-1, tok[1:, None])[:, 0]
        total += k3_kl(got, lp.double()) * got.numel()
        cnt += got.numel()
    return total, cnt


class Case:
    """One model at one layout on this rank: its samples, sequence-parallel position, replayer."""

    def __init__(self, model, arch, d: dict, ids: list[int]):
        from megatron.core import parallel_state as ps

        self.model, self.arch, self.d, self.ids = model, arch, d, ids
        self.dp = ps.get_data_parallel_world_size()
        self.replayer = RouterReplayer(model)
        self.sp = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                       sequence_parallel=bool(model.config.sequence_parallel))
        self.full = RoutesBatch.from_field(d["routes"], d["num_experts"])
        self.last_stage = ps.is_pipeline_last_stage()
        self.seq_len = d["tokens"].shape[1]

    def forward(self, mode: Mode, tokens, inputs, aligned=None):
        self.replayer.set_mode(mode)
        if aligned is not None:
            self.replayer.queue_microbatch(aligned)
        logits = forward_logits(self.model, tokens, self.arch.vocab_size, **inputs)
        self.replayer.check_consumed()
        return logits

    def rollout_metrics(self, packed: bool) -> torch.Tensor:
        """[disagreement decisions, decisions, k3 sum without, k3 sum with, k3 tokens]"""
        toks = [self.d["tokens"][i] for i in self.ids]
        lengths = [self.seq_len] * len(toks)
        padded_len = None if packed else self.seq_len
        tok, inputs = _inputs(toks, padded_len)
        aligned = align_microbatch(self.full, self.ids, padded_len=padded_len,
                                   stage_layers=self.replayer.layer_ids, **self.sp)
        ref_lp = [self.d["logprobs"][i] for i in self.ids]
        out = torch.zeros(5, dtype=torch.float64)
        logits = self.forward(Mode.RECORD, tok, inputs)
        rec = [r[0] for r in self.replayer.pop_recorded()]
        out[0] = sum(router_disagreement(r, a) * r.numel() for r, a in zip(rec, aligned))
        out[1] = sum(r.numel() for r in rec)
        with_r3 = self.forward(Mode.REPLAY, tok, inputs, aligned)
        if self.replayer.pop_recorded() != [[] for _ in self.replayer.replays]:
            raise AssertionError("replay mode kept routes although no record was asked for")
        if self.last_stage and self.sp["tp_rank"] == 0:
            out[2], out[4] = _k3(logits, lengths, packed, ref_lp, toks)
            out[3], _ = _k3(with_r3, lengths, packed, ref_lp, toks)
        return out

    def fidelity(self, packed: bool, names=("rollout", "random", "shuffled")) -> dict[str, torch.Tensor]:
        lengths = [self.d["lengths"][i] for i in self.ids]
        toks = [self.d["tokens"][i, :n] for i, n in zip(self.ids, lengths)]
        padded_len = None if packed else self.seq_len
        tok, inputs = _inputs(toks, padded_len)
        out = {}
        for name in names:
            samples = self.d["forced_sets"][name]
            routes = RoutesBatch(samples, self.full.layer_ids, self.full.num_experts, self.full.topk)
            aligned = align_microbatch(routes, self.ids, padded_len=padded_len, stage_layers=self.replayer.layer_ids,
                                       **self.sp)
            with capture_routing_maps(self.model) as maps:
                logits = self.forward(Mode.REPLAY, tok, inputs, aligned)
            diff, rel = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
            if logits is not None:
                refs = self.d["reference_packed"][self.dp] if packed else self.d["reference"]
                ref = refs["rollout" if name == "shuffled" else name]        # shuffled: against the original routes
                pairs = [(got.double(), ref[i].double()) for got, i in zip(_per_sample(logits, lengths, packed),
                                                                         self.ids)]
                diff = max((g - r).abs().max() for g, r in pairs)
                rel = max(((g - r).abs().amax(-1) / r.abs().amax(-1)).max() for g, r in pairs)
            out[f"diff_{name}"], out[f"rel_{name}"] = diff, rel
            if name != "shuffled":
                out[f"dispatch_{name}"] = self.dispatcher_mismatch(maps, [samples[i] for i in self.ids], lengths,
                                                                   padded_len)
        return out

    def dispatcher_mismatch(self, maps, samples, lengths, padded_len) -> torch.Tensor:
        """[tokens whose dispatcher routing differs from the rollout-format routes, tokens checked]"""
        bad = tot = 0
        if sorted(maps) != sorted(self.replayer.layer_ids):
            raise AssertionError(f"dispatcher saw layers {sorted(maps)}, the stage routes {self.replayer.layer_ids}")
        for layer, got in maps.items():
            if len(got) != 1:
                raise AssertionError(f"layer {layer}: {len(got)} dispatches for one microbatch")
            ids = map_to_ids(got[0], self.full.topk)
            want = expected_rows(samples, self.full.layer_ids.index(layer), lengths, padded_len=padded_len,
                                 num_experts=self.full.num_experts, **self.sp)
            if ids.shape != want.shape:
                bad, tot = bad + max(len(ids), len(want)), tot + max(len(ids), len(want))
                continue
            bad += int((ids != want).any(-1).sum())
            tot += len(want)
        return torch.tensor([bad, tot], dtype=torch.float64)

    def timing(self, reps: int) -> torch.Tensor:
        import statistics
        import time

        tok = self.d["tokens"][self.ids]
        aligned = align_microbatch(self.full, self.ids, padded_len=self.seq_len, stage_layers=self.replayer.layer_ids,
                                   **self.sp)
        t_off, t_on = [], []
        for _ in range(reps + 1):
            for mode, acc in ((Mode.DISABLED, t_off), (Mode.REPLAY, t_on)):
                dist.barrier()
                t0 = time.perf_counter()
                self.forward(mode, tok, {}, aligned if mode is Mode.REPLAY else None)
                acc.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(t_off[1:]), statistics.median(t_on[1:])])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t


def run_case(case: Case, timing: int, sets=("rollout", "random")) -> dict:
    rec: dict = {}
    kinds = (("padded", False), ("packed", True))
    if has_delta_net(case.model.config):
        kinds = kinds[:1]           # packed samples refused on the hybrid (megatron/forward.refuse_packed_on_hybrid)
        rec["packed"] = {"refused": "hybrid linear attention: the delta-net's state would run across samples"}
    for kind, packed in kinds:
        m = case.rollout_metrics(packed)
        dist.all_reduce(m)
        rec[kind] = {"disagreement_without": float(m[0] / max(m[1], 1)), "decisions": int(m[1]),
                     "kl_without": float(m[2] / max(m[4], 1)), "kl_with": float(m[3] / max(m[4], 1))}
        f = case.fidelity(packed, (*sets, "shuffled"))
        for k, v in f.items():
            dist.all_reduce(v, op=dist.ReduceOp.MAX if k.startswith(("diff", "rel")) else dist.ReduceOp.SUM)
        rec[kind].update({
            "fidelity_max_diff": {n: float(f[f"diff_{n}"]) for n in sets},
            "fidelity_max_rel": {n: float(f[f"rel_{n}"]) for n in sets},
            "shuffled_routes_diff": float(f["diff_shuffled"]), "shuffled_routes_rel": float(f["rel_shuffled"]),
            "dispatcher_mismatched_tokens": {n: int(f[f"dispatch_{n}"][0]) for n in sets},
            "dispatcher_tokens": {n: int(f[f"dispatch_{n}"][1]) for n in sets}})
    if timing:
        t = case.timing(timing)
        rec["forward_s"] = {"without": float(t[0]), "with_replay": float(t[1])}
    return rec


def adapter_cases(model, arch, path: str, d: dict, ids: list[int]) -> dict:
    """The same model with the served expert adapter in its LoRA (imported from the PEFT tensors vLLM served):
    replay the routes vLLM captured in each serving mode, against HF with the adapter merged forced to them."""
    from ..lora import LoRAConfig, adapter_factors, apply_lora
    from ..refit.import_peft import load_peft
    from .route_reference import random_expert_adapter

    ad = d["adapter"]
    apply_lora(model, LoRAConfig(rank=ad["rank"], alpha=ad["alpha"], targets=("experts",),
                                 adapter_layout="per_expert"))
    loaded = load_peft(model, arch, random_expert_adapter(arch, ad["rank"], seed=ad["seed"], fused_fc1=True))
    out = {}
    for mode, x in ad["modes"].items():
        dd = {**x, "num_experts": d["num_experts"]}
        case = Case(model, arch, dd, ids)
        out[mode] = {**run_case(case, 0, sets=("rollout",)), "lora_factors_loaded": loaded}
        case.replayer.detach()
    # negative control of the import: the LoRA zeroed (the base model) replaying the same routes is far from the
    # adapted reference
    with torch.no_grad():
        for _, p in adapter_factors(model):
            p.zero_()
    mode, x = next(iter(ad["modes"].items()))
    case = Case(model, arch, {**x, "num_experts": d["num_experts"]}, ids)
    f = case.fidelity(False, ("rollout",))["diff_rollout"]
    dist.all_reduce(f, op=dist.ReduceOp.MAX)
    case.replayer.detach()
    out["without_adapter_diff"] = float(f)
    return out


def main(argv=None):
    from megatron.core import parallel_state as ps

    def add(ap):
        ap.add_argument("--data", required=True, help="the forced-set file written by replay.add_forced_sets")
        ap.add_argument("--timing", type=int, default=0, help="also time N forward passes without / with replay")
        ap.add_argument("--adapter-layouts", default="", help="layouts that also replay the routes captured while "
                        "vLLM served an expert adapter, with that adapter in Megatron's LoRA")

    a = worker_args(argv, add, models_at_layouts=True)
    data = torch.load(a.data, weights_only=False)
    out: dict = {}
    for key, layout, _, path in each_model_at_layout(a):
        d = data[path]
        arch, model = build_from_hf(path, layout, a.rc)
        dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n = d["tokens"].shape[0]
        if n % dp:
            raise ValueError(f"{n} samples do not split over data parallel size {dp} (layout {key})")
        ids = list(range(dpr * n // dp, (dpr + 1) * n // dp))
        case = Case(model, arch, d, ids)
        out.setdefault(key, {})[path] = run_case(case, a.timing)
        case.replayer.detach()
        del case
        if key in a.adapter_layouts.split(",") and "adapter" in d:
            out.setdefault("adapter", {}).setdefault(key, {})[path] = adapter_cases(model, arch, path, d, ids)
        del model
    finish_worker(out, a.result)

if __name__ == "__main__":
    main()
