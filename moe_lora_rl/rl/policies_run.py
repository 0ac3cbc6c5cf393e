"""Several policies on one base and one engine pool (the run config's `policies`, rl/config/policy_settings.py).

One Megatron base holds every policy's adapters in its adapter bank (policy/bank.py: one active at a time, swapped
in place); one set of engines holds every policy's newest version at once (inflight=pin, each commit naming its
policy: vllm/versions.py) and serves each request with its own policy's version. Each policy is run as a run of one
policy is (rl/run.py's pieces) with its own config, problems, seeds, metrics, checkpoints and PEFT adapter in
out_dir/<name>/. The engine numbers versions over all policies; each policy's own version count is what its
metrics and checkpoints show.

The policies take their steps in turn, in one loop (PoliciesRun.loop: a run of one policy's step, GRPORun.update
and record, from that policy's rollout source). The sources: mode=async, each policy's own producer on the shared
engines (rl/async_source.py; its own staleness bound, counted in its own pushes); mode=sync, each policy's step
generated in its turn while the policy before it trains, or every policy's step in one engine batch with
policies_rollout=batched (rl/shared_sources.py).

A policy that fails (a non-finite loss, an adapter or input the engine refuses: an error every rank sees) stops
alone, with one line in its log and the reason in the summaries; its checkpoints stay as they were, and the other
policies go on.

    summary = PoliciesRun(cfg, world_size).run()     # {"policies": {name: its summary}, "wall_s", ...}
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from .run import GRPORun
from .shared_sources import Batched, Turns
from .source import SyncSource


class PolicyRun(GRPORun):
    """One policy of the job: GRPORun's pieces on the job's base (its bank's adapter set made active whenever the
    policy is used) and the job's engines (its requests pinned to its own version)."""

    def __init__(self, job: "PoliciesRun", name: str, cfg):
        super().__init__(cfg, job.world)
        self.job, self.owner = job, name

    @property
    def policy(self):
        self.job.bank.activate(self.owner)
        return self.job.policy

    def engine_version(self) -> int:
        return self.job.ids[(self.owner, self.job.bank.version(self.owner))]     # read without switching

    def serving_version(self) -> int:
        return self.engine_version()

    def push(self, restarts: bool = True, after_restart=None, engines=None) -> int:
        self.job.allocate(self.owner, self.policy.version)          # every rank, in the same order
        return super().push(restarts, after_restart, engines)

    def export_adapter(self) -> None:
        """As GRPORun's, then (rank 0) cut to the policy's own rank and targets when the base's adapter modules are
        larger: the adapter the policy would have exported alone."""
        from ..refit.export import trim_peft_dir

        super().export_adapter()
        own, module = self.job.bank.lora(self.owner), self.job.bank.module
        if self.rank == 0 and (own.rank, own.targets) != (module.rank, module.targets):
            trim_peft_dir(self.out / "adapter", own, self.policy.arch)

    def summary(self, history: list, evals: dict, wall: float) -> dict:
        s = super().summary(history, evals, wall)
        return {**s, "failed": self.job.failed[self.owner]} if self.owner in self.job.failed else s

    def _restart(self, what: str, died: tuple, attempt: int, after_restart=None) -> int:
        """As GRPORun's, but the restarted engines get every policy's current version, in the engine's order."""
        why, index = died
        if attempt == self.cfg.engine_restarts:
            raise RuntimeError(f"the rollout engine died during {what} {attempt + 1} times "
                               f"(engine_restarts={self.cfg.engine_restarts}); giving up: {why}")
        self.log.note(f"rollout engine {index} died during {what}: {why}; restarting it "
                      f"({attempt + 1}/{self.cfg.engine_restarts}), pushing every policy's version, repeating {what}")
        self.engine_restarts += 1
        _, restarted = self._revive(index)
        pushed = 0
        for r in sorted(self.job.runs, key=lambda r: r.engine_version()):
            pushed += r.push(restarts=False, engines=restarted)
        if self.rank == 0 and after_restart is not None:
            for i in restarted:
                after_restart(i)
        return pushed


class PoliciesRun:
    def __init__(self, cfg, world_size: int, source=SyncSource):
        """source: the mode's rollout source (rl/modes.py); each policy gets its own (sources)."""
        self.cfg, self.world, self.source_class = cfg, world_size, source
        self.rank = int(os.environ.get("RANK", "0"))
        self.out = Path(cfg.out_dir)
        self.ids: dict[tuple[str, int], int] = {}      # (policy, its version) -> the engine's version number
        self.failed: dict[str, str] = {}                # policy -> why it stopped
        self.runs: list[PolicyRun] = []

    def allocate(self, name: str, version: int) -> int:
        """The engine's number for a policy's version: new ones increase over every policy's pushes."""
        return self.ids.setdefault((name, version), len(self.ids) + 1)

    def setup(self) -> None:
        """The shared pieces once (base, tokenizer, the engines' producer), the bank, then each policy's own."""
        from ..policy.bank import AdapterBank, PolicyAdapter
        from .config.policy_settings import module_lora, policy_configs
        from .inputs import load_problems
        from .producer import Producer

        head = GRPORun(dataclasses.replace(self.cfg, lora=module_lora(self.cfg)), self.world)
        head.setup()
        self.head, self.policy = head, head.policy
        configs = policy_configs(self.cfg)
        self.bank = AdapterBank(head.policy.core, {
            name: PolicyAdapter(pcfg.algo.lr, pcfg.lora.lora_config(init_seed=pcfg.seed)) for name, pcfg in configs})
        for name, pcfg in configs:
            r = PolicyRun(self, name, pcfg)
            r.path, r.warmup, r.tok, r.template = head.path, head.warmup, head.tok, head.template
            r.moe_layers, r.setup_s = head.moe_layers, head.setup_s
            r.train_problems, r.eval_problems, r.filtered = load_problems(pcfg, head.tok, head.template)
            r.prod = Producer(pcfg, head.tok, head.path, r.train_problems, r.eval_problems, r.out,
                              template=head.template)
            self.runs.append(r)

    def turns(self) -> list[tuple[int, PolicyRun]]:
        """Each (step, policy) in the order the policies take them (from each one's first step: a resumed one's)."""
        return [(step, r) for step in range(min(self.start.values()), self.cfg.steps) for r in self.runs
                if step >= self.start[r.owner]]

    def live(self, step: int) -> list[PolicyRun]:
        return [r for r in self.runs if r.owner not in self.failed and step >= self.start[r.owner]]

    def sources(self, opened: dict):
        """Each policy's rollout source (set as its run's), and the context they share: mode=async, each policy's
        own producer (after an engine's restart every producer regenerates what it lost); mode=sync, the policies'
        steps generated in turns, or in one batch (rl/shared_sources.py)."""
        if self.source_class is SyncSource:
            shared = (Batched if self.cfg.policies_rollout == "batched" else Turns)(self)
            for r in self.runs:
                r.source = shared.source(r)
            return shared
        peers: list = []
        for r in self.runs:
            r.source = self.source_class(r, opened[r.owner][3], peers=peers)
            peers.append(r.source)
        return contextlib.nullcontext()

    def loop(self, opened: dict) -> None:
        """Each live policy's step in turn: GRPORun's step from the policy's own source, then its record; a failure
        every rank sees (a non-finite loss, an input or adapter refused) stops that policy alone."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.sources(opened))
            for r in self.runs:
                stack.enter_context(r.source)
            for step, r in self.turns():
                if r.owner in self.failed:
                    continue
                try:
                    m = r.update(step, r.source)
                    if not math.isfinite(m.get("loss", 0.0)):
                        raise ValueError(f"non-finite loss {m['loss']}")
                except (ValueError, RuntimeError) as e:    # raised on every rank: the policy stops alone
                    self.failed[r.owner] = f"step {step + 1}: {' '.join(str(e).split())}"
                    r.log.note(f"policy {r.owner} stopped at {self.failed[r.owner]}; the other policies go on")
                    r.source.close()
                    continue
                _, history, evals, _ = opened[r.owner]
                r.record(step, m, history, evals, r.source)

    def run(self) -> dict:
        cfg = self.cfg
        self.setup()
        opened = {r.owner: r.open() for r in self.runs}
        self.start = {name: o[0] for name, o in opened.items()}
        t0 = time.perf_counter()
        if self.rank == 0:
            self.head.prod.start()
        dist.barrier()
        for r in self.runs:
            r.prod.engines = self.head.prod.engines
            r.push()                                      # version 0, or the resumed one
        t_rl = time.perf_counter()                        # as a run of one policy: its first evaluation on
        for r in self.runs:
            r.setup_s += t_rl - t0
            r.begin(opened[r.owner][2])
        self.loop(opened)
        wall = time.perf_counter() - t_rl
        summaries = {r.owner: r.finish(opened[r.owner][1], opened[r.owner][2], time.perf_counter() - r.t_rl)
                     for r in self.runs}
        summary = {"wall_s": wall, "setup_s": self.head.setup_s, "mode": cfg.mode, "replay": cfg.replay,
                   "layout": cfg.layout.layout().name, "model": str(self.head.path),
                   "failed": dict(self.failed),
                   "policies": {n: {k: v for k, v in s.items() if k != "evals"} for n, s in summaries.items()}}
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            self.head.prod.stop()
        return summary
