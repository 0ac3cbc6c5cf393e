"""Several policies on one base and one engine pool (the run config's `policies`, rl/config/policy_settings.py).

One Megatron base holds every policy's adapters in its adapter bank (policy/bank.py: one active at a time, swapped
in place); one set of engines holds every policy's newest version at once (inflight=pin, each commit naming its
policy: vllm/versions.py) and serves each request with its own policy's version. Each policy is run as a run of one
policy is (rl/run.py's pieces) with its own config, problems, seeds, metrics, checkpoints and PEFT adapter in
out_dir/<name>/. The engine numbers versions over all policies; each policy's own version count is what its
metrics and checkpoints show.

The policies take their steps in turn, and while one trains the engines generate the next policy's step (rank 0
starts it in a thread once the trainer's turn begins): that policy's version is already final (it was pushed at
the end of its own last turn), so each rollout is on-policy, as when the policies run alone. A generation begun
ahead that fails is repeated in turn, with the engines' recovery.

With policies_rollout=batched, every policy's step is instead generated in one engine batch (each request pinned
to its own policy's version: the requests of all policies share the engine's decode steps), then each policy trains
and pushes in turn; if that batch fails, each policy's step is generated alone, so a bad input stops its policy only.

A policy that fails (a non-finite loss, an adapter or input the engine refuses: an error every rank sees) stops
alone, with one line in its log and the reason in the summaries; its checkpoints stay as they were, and the other
policies go on.

    summary = PoliciesRun(cfg, world_size).run()     # {"policies": {name: its summary}, "wall_s", ...}
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch.distributed as dist

from .async_run import AsyncGRPORun
from .run import GRPORun


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


class AsyncPolicyRun(PolicyRun, AsyncGRPORun):
    """One policy of a mode=async job: its own producer on the job's engines (its requests pinned to its newest
    pushed version), its own staleness bound counted in its own pushes, taking its turn to train."""

    def pipe_recover(self, index: int) -> None:
        for r in self.job.runs:                   # every policy's streams to that engine were lost
            if getattr(r, "pipe", None) is not None:
                r.pipe.recover(index)


class PoliciesRun:
    def __init__(self, cfg, world_size: int):
        self.cfg, self.world = cfg, world_size
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
        kind = AsyncPolicyRun if self.cfg.mode == "async" else PolicyRun
        for name, pcfg in configs:
            r = kind(self, name, pcfg)
            r.path, r.warmup, r.tok, r.template = head.path, head.warmup, head.tok, head.template
            r.moe_layers, r.setup_s = head.moe_layers, head.setup_s
            r.train_problems, r.eval_problems, r.filtered = load_problems(pcfg, head.tok, head.template)
            r.prod = Producer(pcfg, head.tok, head.path, r.train_problems, r.eval_problems, r.out,
                              template=head.template)
            self.runs.append(r)

    def take_turns(self, turns: list, opened: dict) -> None:
        """Each (step, policy) in order; rank 0 generates the next turn's step while this one trains, when the next
        turn is another policy's (the same policy's next step would need this turn's version)."""
        from concurrent.futures import ThreadPoolExecutor

        ahead = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if self.rank == 0 else None
        started = {}
        try:
            for k, (step, r) in enumerate(turns):
                if r.owner in self.failed:
                    continue

                def begin_next(k=k, r=r):                  # once this turn's rollout is in: the next one's
                    nxt = next((j for j in range(k + 1, len(turns)) if turns[j][1].owner not in self.failed), None)
                    if nxt is not None and turns[nxt][1] is not r:     # decided alike on every rank
                        started[nxt] = ahead.submit(turns[nxt][1].generation(turns[nxt][0], {})) \
                            if ahead is not None else True
                self.turn(step, r, opened, started=started.pop(k, None), then=begin_next)
        finally:
            if ahead is not None:
                ahead.shutdown(wait=True, cancel_futures=True)
                for k, fut in started.items():    # begun for a policy that stopped before its turn: never scored
                    if not fut.cancelled() and fut.exception() is None:
                        turns[k][1].prod.release(fut.result()[0])

    def take_async_steps(self, opened: dict) -> None:
        """mode=async: every policy's producer keeps the engines full within its own bound while the policies take
        their updates in turn (each takes its finished groups, trains and pushes in flight)."""
        for r in self.runs:
            r.open_pipe(opened[r.owner][3])
        try:
            for step in range(min(o[0] for o in opened.values()), self.cfg.steps):
                for r in self.runs:
                    if r.owner in self.failed or step < opened[r.owner][0]:
                        continue
                    try:
                        m = r.async_step(step)
                        if not math.isfinite(m.get("loss", 0.0)):
                            raise ValueError(f"non-finite loss {m['loss']}")
                    except (ValueError, RuntimeError) as e:    # raised on every rank: the policy stops alone
                        self.stop_policy(r, step, e)
                        r.close_pipe()
                        continue
                    _, history, evals, _ = opened[r.owner]
                    r.record_async(step, m, history, evals)
        finally:
            for r in self.runs:
                r.close_pipe()

    def stop_policy(self, r: PolicyRun, step: int, e: BaseException) -> None:
        self.failed[r.owner] = f"step {step + 1}: {' '.join(str(e).split())}"
        r.log.note(f"policy {r.owner} stopped at {self.failed[r.owner]}; the other policies go on")

    def take_batched_steps(self, opened: dict) -> None:
        """Each step: every live policy's groups in one engine batch, then each policy trains and pushes."""
        for step in range(min(o[0] for o in opened.values()), self.cfg.steps):
            live = [r for r in self.runs if r.owner not in self.failed and step >= opened[r.owner][0]]
            if not live:
                break
            try:
                rolled = live[0]._on_engine(f"the batched rollout of step {step + 1}", self.batched(step, live))
            except (ValueError, RuntimeError) as e:        # every rank: each policy's step generated alone below
                live[0].log.note(f"the batched rollout of step {step + 1} failed ({' '.join(str(e).split())}); "
                                 "generating each policy's step alone")
                rolled = {}
            for r in live:
                self.turn(step, r, opened, rolled.get(r.owner))

    def batched(self, step: int, live: list):
        """Rank 0: a function generating every live policy's groups of `step` in one engine call per engine, each
        request pinned to its own policy's version; {policy: (samples, kv, plans)}."""
        from ..rollout.replicas import gather, spread

        items = [(r, p) for r in live for p in r.plans(step)]
        version = {r.owner: r.serving_version() for r in live}
        g = self.cfg.algo.group_size
        keep: dict = {}

        def engine_part(i, engine, parts):
            prompts, seeds, versions = [], [], []
            for r, p in (items[k] for k in parts[i]):
                req = r.prod.requests([p])
                prompts += req["prompts"]
                seeds += req["seeds"]
                versions += [version[r.owner]] * len(req["prompts"])
            return engine.generate(prompts, seeds=seeds, versions=versions, **live[0].prod.sampling())

        def generate():                            # rank 0, the engines' side
            t0 = time.perf_counter()
            parts = spread(len(items), len(self.head.prod.engines))
            done = self.head.prod.engines.map(lambda i, e: engine_part(i, e, parts),
                                              [i for i, p in enumerate(parts) if p], keep)
            groups = gather(parts, {i: [s[j:j + g] for j in range(0, len(s), g)] for i, s in done.items()},
                            len(items))
            out = {}
            for (r, p), grp in zip(items, groups):
                out.setdefault(r.owner, ([], {}, []))
                out[r.owner][0].extend(grp)
                out[r.owner][2].append(p)
            for r in live:
                r.busy["rollout"] += (time.perf_counter() - t0) / len(live)
            return out

        return generate

    def turn(self, step: int, r: PolicyRun, opened: dict, rolled=None, started=None, then=None) -> None:
        """One policy's step: its rollout (given, begun ahead, or now), then(), training and the push, the record;
        a failure every rank sees stops the policy alone."""
        try:
            samples, kv, plans = rolled if rolled is not None else r.rollout(step, started)
            if then is not None:
                then()
            m = r.train_push(samples, kv, plans)
            if not math.isfinite(m.get("loss", 0.0)):
                raise ValueError(f"non-finite loss {m['loss']}")
        except (ValueError, RuntimeError) as e:    # raised on every rank: the policy stops alone
            self.stop_policy(r, step, e)
            return
        _, history, evals, _ = opened[r.owner]
        r.record(step, m, history, evals)

    def run(self) -> dict:
        cfg = self.cfg
        self.setup()
        opened = {r.owner: r.open() for r in self.runs}
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
        turns = [(step, r) for step in range(min(o[0] for o in opened.values()), cfg.steps) for r in self.runs
                 if step >= opened[r.owner][0]]
        if cfg.mode == "async":
            self.take_async_steps(opened)
        elif cfg.policies_rollout == "batched":
            self.take_batched_steps(opened)
        else:
            self.take_turns(turns, opened)
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
