"""torchrun worker: R3 in Megatron at each layout against routes and logprobs of a rollout engine.
Without replay (routes recorded) and with R3 (routes replayed), padded (BSHD) and packed: router disagreement with
the rollout routes, k3 KL to the rollout logprobs, consumed-once check. Rank 0 writes JSON."""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..megatron.build import build_model
from ..megatron.forward import forward_logits, packed_inputs
from ..megatron.hf_reference import load_arch
from ..megatron.layout import Layout
from ..megatron.load import load_hf_weights
from ..megatron.parallel import init_distributed, teardown
from ..megatron.run_config import prepare_host
from ..testing.launch import finish_worker
from ..router_replay.align import align_microbatch
from ..router_replay.metrics import router_disagreement
from ..router_replay.replay import Mode, RouterReplayer
from ..router_replay.routes import RoutesBatch
from .run_args import from_worker_arg


def _pass(model, replayer, mode, tokens, inputs, aligned, vocab):
    replayer.set_mode(mode)
    if mode is Mode.DISABLED:
        return forward_logits(model, tokens, vocab, **inputs), 0, 0
    if mode is Mode.REPLAY:
        replayer.queue_microbatch(aligned)
    logits = forward_logits(model, tokens, vocab, **inputs)
    replayer.check_consumed()
    rec = [r[0] for r in replayer.pop_recorded()]
    mism = sum(router_disagreement(r, a) * r.numel() for r, a in zip(rec, aligned))
    total = sum(r.numel() for r in rec)
    return logits, mism, total


def _k3(logits, tokens, ref_lp, packed_lengths=None):
    from ..router_replay.metrics import k3_kl

    lp = torch.log_softmax(logits.double(), -1)
    if packed_lengths is None:
        got = lp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
        return k3_kl(got, ref_lp.double()) * got.numel(), got.numel()
    out, n, start = 0.0, 0, 0
    for i, L in enumerate(packed_lengths):
        seg = lp[0, start:start + L - 1].gather(-1, tokens[0, start + 1:start + L, None])[:, 0]
        out += k3_kl(seg, ref_lp[i].double()) * seg.numel()
        n += seg.numel()
        start += L
    return out, n


def main(argv=None):
    from megatron.core import parallel_state as ps

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--timing", type=int, default=0, help="also time N forward passes without / with replay")
    ap.add_argument("--run-config", default="", help="RunConfig as JSON (run_args.worker_arg); default fp32 on CPU")
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    rc = from_worker_arg(a.run_config)
    prepare_host(rc)
    data = torch.load(a.data)
    out: dict = {}
    for key in a.layouts.split(","):
        layout = Layout.parse(key)
        init_distributed(layout, rc)
        for path in a.models.split(","):
            d = data[path]
            routes = RoutesBatch.from_field(d["routes"], d["num_experts"])
            arch = load_arch(path)
            model = build_model(arch, layout, rc)
            load_hf_weights(model, path, arch)
            replayer = RouterReplayer(model)
            dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            n, s = d["tokens"].shape
            ids = list(range(dpr * n // dp, (dpr + 1) * n // dp))
            tokens = d["tokens"][ids]
            sp = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                      sequence_parallel=bool(model.config.sequence_parallel))
            stats = torch.zeros(12, dtype=torch.float64)
            for j, packed in enumerate((False, True)):
                if packed:
                    lens = [s] * len(ids)
                    pos, mask = packed_inputs(lens)
                    tok, inputs = tokens.reshape(1, -1), {"position_ids": pos, "attention_mask": mask}
                    aligned = align_microbatch(routes, ids, padded_len=None, stage_layers=replayer.layer_ids, **sp)
                    ref = [d["logprobs"][i] for i in ids]
                else:
                    lens, tok, inputs = None, tokens, {}
                    aligned = align_microbatch(routes, ids, padded_len=s, stage_layers=replayer.layer_ids, **sp)
                    ref = torch.stack([d["logprobs"][i] for i in ids])
                for m, mode in enumerate((Mode.RECORD, Mode.REPLAY)):
                    logits, mism, total = _pass(model, replayer, mode, tok, inputs, aligned, arch.vocab_size)
                    base = j * 6 + m * 3
                    stats[base] += mism
                    stats[base + 1] += total
                    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                        k, cnt = _k3(logits, tok, ref, lens)
                        stats[base + 2] += k / max(cnt, 1) / dp      # mean over this DP rank's tokens, averaged
            if a.timing:
                import statistics
                import time

                aligned = align_microbatch(routes, ids, padded_len=s, stage_layers=replayer.layer_ids, **sp)
                t_off, t_on = [], []
                for _ in range(a.timing + 1):
                    for mode, acc in ((Mode.DISABLED, t_off), (Mode.REPLAY, t_on)):
                        dist.barrier()
                        t0 = time.perf_counter()
                        _pass(model, replayer, mode, tokens, {}, aligned, arch.vocab_size)
                        acc.append(time.perf_counter() - t0)
                timing = torch.tensor([statistics.median(t_off[1:]), statistics.median(t_on[1:])])
                dist.all_reduce(timing, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            rec = {}
            for j, name in enumerate(("padded", "packed")):
                b = j * 6
                rec[name] = {"disagreement_without": stats[b] / max(stats[b + 1], 1),
                             "disagreement_with": stats[b + 3] / max(stats[b + 4], 1),
                             "decisions": int(stats[b + 1]), "kl_without": float(stats[b + 2]),
                             "kl_with": float(stats[b + 5])}
            out.setdefault(key, {})[path] = {k: {kk: float(vv) for kk, vv in v.items()} for k, v in rec.items()}
            if a.timing:
                out[key][path]["forward_s"] = {"without": float(timing[0]), "with_replay": float(timing[1])}
            replayer.detach()
            del model
        teardown()
    finish_worker(out, a.result)


if __name__ == "__main__":
    main()
