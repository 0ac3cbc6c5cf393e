"""Fault injection on every weight path of one engine (the tiny model in fp32, started empty): each cell sends a
version with one fault at one stage and checks the three properties of a refused update:

    same     the engine serves the previous version exactly: prompt logprobs max |diff| 0 and k3 <= 1e-10 against
             those measured just before (an engine left on the meta device fails the request: inf)
    reports  moe_lora_base_status / moe_lora_status name the previous version
    next     the next correct version is accepted and serves exactly its reference logprobs (which differ from the
             previous version's: the negative control that the comparison sees a change)

Base paths (vllm/base_sync.py): shm, http (inline), gloo (a broadcast group of one engine). Adapter paths
(vllm/worker_ext.py): in-process staged push (begin/bucket/commit), one-shot in-process push, shared memory
(moe_lora_push_shm), HTTP's engine half (moe_lora_push_blob / moe_lora_bucket_blob). Faults: a tensor's shape
(one row too many, sent last), a name the model lacks, an integer dtype, a missing tensor, a byte flipped after
the digest, an exception raised inside the load (a layer's post-load processing, or the last tensor's loader),
and a sender that dies mid-version (the engine loop holds requests until its base_timeout_s, then aborts it).
Used by tests/e2e/test_weight_faults.py; docs/bad_input.md has the table.

    python -m kit.weight_faults --model DIR [--cells ci|all] [--only base/shm:finish:shape,...]
                                                                                prints "RESULT <json>"
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
from moe_lora_rl.checks.torchrun import run_process
from .weight_fault_cells import adapter_cells, base_cells, loop_cells

STAGE_TIMEOUT_S = 6.0       # the engine's stage_timeout_s: an abandoned update expires within a cell


def run_weight_faults(model: str, cwd, cells: str = "ci") -> dict:
    return run_process("kit.weight_faults", ["--model", model, "--cells", cells], cwd=cwd,
                       what="weight fault matrix")


def _k3(before, after) -> float:
    """k3 = E[r - 1 - log r], r = p_before / p_after, over every prompt token (inf when `after` failed)."""
    import torch

    if not isinstance(after, torch.Tensor):
        return math.inf
    d = (before - after).double()
    return float((d.exp() - 1 - d).mean())


class Matrix:
    """The engine, its references and the cells' records."""

    def __init__(self, llm, model: str):
        import torch

        from moe_lora_rl.models.arch import load_arch
        from moe_lora_rl.transfer.shm_sender import checkpoint_tensors

        self.llm, self.model = llm, model
        self.arch = load_arch(model)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        self.seqs = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(3)]
        base = checkpoint_tensors(model)
        self.bases = {"A": base, "B": {k: v * 1.05 for k, v in base.items()}}
        self.refs: dict = {}            # ("base", "A") / ("adapter", 1) -> logprobs
        self.version = {"base": 0, "adapter": 0}
        self.next_kind = {"base": "A", "adapter": 1}
        self.records: list = []
        self.stage_timeout_s = STAGE_TIMEOUT_S
        self.only: set = set()          # "path:stage:fault" of the cells to run (empty: every cell of the set)

    def rpc(self, method, *args):
        return self.llm.collective_rpc(method, args=args)[0]

    def logprobs(self):
        from moe_lora_rl.checks.vllm_logprobs import prompt_logprobs

        try:
            return prompt_logprobs(self.llm, self.seqs)
        except Exception as e:  # noqa: BLE001 - a broken engine: the error is the result
            return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"

    def served(self, what: str):
        if what == "base":
            return self.rpc("moe_lora_base_status")["served"]
        return self.rpc("moe_lora_status")["version"]

    def correct(self, what: str, send) -> dict:
        """The next correct version of `what` sent by send(version, kind); checked against its reference (taken the
        first time that kind is served)."""
        kind = self.next_kind[what]
        self.next_kind[what] = ({"A": "B", "B": "A"} if what == "base" else {1: 2, 2: 1})[kind]
        v = self.version[what] + 1
        try:
            send(v, kind)
        except Exception as e:  # noqa: BLE001 - refused: the cell's "next" property fails
            return {"next_ok": False, "next_error": " ".join(str(e).split())[:200]}
        self.version[what] = v
        lp = self.logprobs()
        ref = self.refs.setdefault((what, kind), lp)
        ok = self.served(what) == v and not isinstance(lp, str) and bool((lp - ref).abs().max() == 0)
        return {"next_ok": ok, "next_version": v}

    def cell(self, path: str, stage: str, fault: str, what: str, inject, send, expect: str = "") -> dict:
        """inject(v) sends version v with the fault; send(v, kind) sends a correct one; expect: a word the refusal
        must hold (a cell whose refusal is the engine's own abort: any other error is a failure)."""
        if self.only and f"{path}:{stage}:{fault}" not in self.only:
            return {}
        before, served = self.logprobs(), self.served(what)
        try:
            inject(self.version[what] + 1)
            refused = ""
            self.version[what] = max(self.version[what], self.served(what) or 0)     # accepted: later cells go on
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            refused = " ".join(str(e).split())[:240] or type(e).__name__
        after = self.logprobs()
        rec = {"path": path, "stage": stage, "fault": fault, "refused": refused, "served_before": served}
        try:
            rec["served_after"] = self.served(what)
        except Exception as e:  # noqa: BLE001
            rec["served_after"] = f"error: {e}"
        rec["serve_error"] = after if isinstance(after, str) else ""
        rec["max_diff"] = None if isinstance(after, str) else float((after - before).abs().max())
        rec["k3"] = _k3(before, after)
        rec["same"] = rec["max_diff"] == 0.0 and rec["k3"] <= 1e-10
        rec["reports"] = rec["served_after"] == served
        print(f"FAULT {path} {stage} {fault}: refused={refused[:160]!r} served_after={rec['served_after']} "
              f"max_diff={rec['max_diff']} serve_error={rec['serve_error'][:80]!r}", flush=True)
        rec.update(self.correct(what, send))
        rec["ok"] = bool(refused) and expect in refused and rec["same"] and rec["reports"] and rec["next_ok"]
        print(f"CELL {path:8s} {stage:8s} {fault:14s} ok={rec['ok']} same={rec['same']} reports={rec['reports']} "
              f"next={rec['next_ok']} :: {refused[:100]} {rec['serve_error'][:80]}", flush=True)
        self.records.append(rec)
        return rec


def main(argv=None) -> dict:
    set_engine_env()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--cells", choices=("ci", "all"), default="ci")
    ap.add_argument("--only", default="", help="comma-separated path:stage:fault cells (e.g. base/shm:finish:shape)")
    a = ap.parse_args(argv)
    llm = make_engine(a.model, dtype="float32", prefix_caching=False, load_format="dummy",
                      stage_timeout_s=STAGE_TIMEOUT_S)
    m = Matrix(llm, a.model)
    m.only = {c for c in a.only.split(",") if c}
    base_cells(m, a.cells)              # the base first: an adapter once served refuses base updates
    loop_cells(m, a.cells)
    adapter_cells(m, a.cells)
    refs = {f"{w}:{k}": v for (w, k), v in m.refs.items()}
    res = {"cells": m.records, "failed": [r for r in m.records if not r["ok"]],
           "refs_differ": {"base": float((refs["base:A"] - refs["base:B"]).abs().max()) if "base:B" in refs else None,
                           "adapter": float((refs["adapter:1"] - refs["adapter:2"]).abs().max())
                           if "adapter:2" in refs else None}}
    print("RESULT " + json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
