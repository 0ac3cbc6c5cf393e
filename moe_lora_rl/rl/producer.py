"""The rollout side of a run, on rank 0: the engine processes (rollout.engines replicas, rollout/replicas.py),
prompts, whole GRPO groups, rewards and the held-out evaluation. Every rank has one (labels and rewards are computed
everywhere); the engines live on rank 0. Both loops use it: the synchronous one asks for a step's groups and waits;
the asynchronous one (rl/pipeline.py) streams groups while the trainer works.

    prod = Producer(cfg, tok, path, train_problems, eval_problems, out_dir); prod.start()
    samples = prod.generate(plans, keep); problems, group_ids = prod.labels(plans)   # plans: group_plan(...)
    prod.evaluate(version=None) -> held-out success;  prod.score(samples, problems) -> (rewards, extras)

Rewards run in rank 0's reward workers (data/rewards.py): a step's calls start as soon as its samples are generated
(prod.submit), and the trainer collects them (prod.score). A sample that will not be trained on (its group dropped
as stale, lost with a dead engine, left at the loop's end) has its call released (prod.release): its entry goes,
its result is never read (a multiprocessing pool cannot cancel a started call; it finishes in the worker).
"""
from __future__ import annotations

from pathlib import Path

from ..rollout.kv_meter import STEP_SUMS, step_fit
from .groups import GroupPlan
from ..data.rewards import RewardWorkers
from .schedule import eval_seed


class Producer:
    def __init__(self, cfg, tok, path, train_problems, eval_problems, out_dir, template: str = "chat"):
        self.cfg, self.tok, self.path = cfg, tok, Path(path)
        self.template = template            # data/prompting.py: chat or plain
        self.train_problems, self.eval_problems = train_problems, eval_problems
        self.out = Path(out_dir)
        self.engines = None                 # rollout/replicas.py's Replicas
        self._prompt_cache: dict[int, list[int]] = {}
        r = cfg.reward
        self.rewarder = RewardWorkers(r.path, r.name, r.timeout_s, r.workers)   # its processes start when first used
        self._pending: dict[int, tuple] = {}  # id(sample) -> (sample, its reward call), started (submit)
        self._eval_prompts = None
        self.eval_lens: list[int] = []       # response lengths (tokens) of the last evaluation
        self._kv_mark: list[dict] | None = None     # the engines' KV meters after the last rollout or evaluation
        self.occ: dict[str, float] = {}       # the engines' step sums (rollout/kv_meter.STEP_SUMS) over training
        #                                       rollouts: evaluation left out (occupancy())

    def start(self) -> None:
        import os
        import socket

        from ..rollout.placement import plan_placements
        from ..rollout.replicas import Replicas

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        n = cfg.rollout.engines
        where = plan_placements(n, nodes=cfg.rollout.node, gpus=cfg.rollout.gpus, this_host=socket.gethostname())
        kw = {"step_delay_s": cfg.delay.engine_step_s, "stage_timeout_s": cfg.rollout.stage_timeout_s,
              "kv_compression": cfg.rollout.kv_compression, "kv_budget": cfg.rollout.kv_budget,
              "kv_evict": cfg.rollout.evict(), "kv_replay": cfg.rollout.kv_replay,
              "expert_precision": cfg.rollout.expert_precision,
              "base_from": cfg.rollout.base_from, "base_bucket_mb": cfg.rollout.base_bucket_mb,
              "base_transport": cfg.rollout.base_transport}
        if cfg.mode == "async":          # the engine keeps generating while versions change
            kw |= {"inflight": cfg.inflight, "on_full": "wait",
                  "max_versions": cfg.max_staleness + 1 if cfg.inflight == "pin" else None}
        if cfg.policies:                 # every policy's version held at once, each request pinned to its policy's
            kw |= {"inflight": "pin", "on_full": "wait", "max_versions": cfg.rollout.max_versions}
        here = sum(p.transport == "shm" for p in where)
        if cfg.rollout.threads is not None:
            kw["threads"] = cfg.rollout.threads
        elif here > 1 and cfg.runtime.device == "cpu":   # replicas on this host share its cores
            kw["threads"] = max(1, len(os.sched_getaffinity(0)) // here)
        self.engines = Replicas.start(str(self.path), where, dtype=cfg.runtime.rollout_dtype, serving=cfg.serving,
                                      log_dir=self.out, seed=cfg.seed, **kw)
        self._kv_mark = self.kv_snapshot()           # the engines' own warm-up left out
        sources = {p.data_source for p in self.train_problems} | {p.data_source for p in self.eval_problems}
        self.rewarder.pool(sources)                  # the reward workers, their functions loaded

    # -- prompts and groups -------------------------------------------------------------------------------------
    def prompt(self, problem: int) -> list[int]:
        """The prompt ids of a training problem (tokenised once)."""
        if problem not in self._prompt_cache:
            self._prompt_cache[problem] = self.encode([self.train_problems[problem]])[0]
        return self._prompt_cache[problem]

    def encode(self, problems) -> list[list[int]]:
        """Prompt ids, data.truncation applied over data.max_prompt_length (data/prompting.fit_prompt)."""
        from ..data.hf_sampling import prompt_ids
        from ..data.prompting import fit_prompt

        d = self.cfg.data
        return [fit_prompt(ids, d.max_prompt_length, d.truncation, f"data row {p.index} (data_source "
                                                                     f"{p.data_source!r})")
                for p, ids in zip(problems, prompt_ids(self.tok, problems, self.template))]

    def requests(self, plans: list[GroupPlan]) -> dict:
        """The engine requests of whole groups, in order: prompts and seeds."""
        g = self.cfg.algo.group_size
        return {"prompts": [self.prompt(p.problem) for p in plans for _ in range(g)],
                "seeds": [s for p in plans for s in p.seeds]}

    def sampling(self) -> dict:
        a = self.cfg.algo
        return {"max_tokens": a.max_response_tokens, "temperature": a.temperature,
                "stop_token_ids": [self.tok.eos_token_id]}

    def generate(self, plans: list[GroupPlan], keep: dict | None = None, version: int | None = None):
        """The samples of whole groups, in order (waiting for all), the groups spread over the engines. keep: the
        finished engines' samples, kept across a restart of a dead one (then only its groups are generated again).
        version (a pin engine): every request served with that held version."""
        from ..rollout.replicas import gather, spread

        def run(i, e):
            req = self.requests([plans[k] for k in parts[i]])
            pinned = None if version is None else [version] * len(req["prompts"])
            return e.generate(**req, **self.sampling(), **({} if pinned is None else {"versions": pinned}))

        parts = spread(len(plans), len(self.engines))
        done = self.engines.map(run,
                                [i for i, p in enumerate(parts) if p], {} if keep is None else keep)
        g = self.cfg.algo.group_size
        groups = gather(parts, {i: [s[j:j + g] for j in range(0, len(s), g)] for i, s in done.items()}, len(plans))
        return [s for grp in groups for s in grp]

    def labels(self, plans: list[GroupPlan]):
        """The problem and the group id (position in `plans`) of each sample of whole groups (any rank)."""
        g = self.cfg.algo.group_size
        problems = [self.train_problems[p.problem] for p in plans for _ in range(g)]
        return problems, [k for k in range(len(plans)) for _ in range(g)]

    def submit(self, samples, problems) -> None:
        """Rank 0: start the samples' reward calls in the workers (score() collects them); any thread."""
        calls = self.rewarder.submit([(p, self.tok.decode(s.response, skip_special_tokens=True))
                                      for s, p in zip(samples, problems)])
        for s, call in zip(samples, calls):
            self._pending[id(s)] = (s, call)          # the sample held: its id cannot be reused meanwhile

    def submit_sample(self, sample, plan: GroupPlan) -> None:
        """Rank 0: start one sample's reward call as it finishes (rl/pipeline.py's streams)."""
        self.submit([sample], [self.train_problems[plan.problem]])

    def score(self, samples, problems) -> tuple[list[float], list[dict]]:
        """Rank 0: the samples' rewards and each one's extra figures (a dict reward's other keys); ValueError,
        one line naming the row, on a bad call. Calls submitted earlier are collected, the others started now."""
        held = [self._pending.pop(id(s), (None, None)) for s in samples]
        todo = [i for i, (h, _) in enumerate(held) if h is not samples[i]]
        if todo:
            self.submit([samples[i] for i in todo], [problems[i] for i in todo])
            for i in todo:
                held[i] = self._pending.pop(id(samples[i]))
        return self.rewarder.collect([call for _, call in held])

    def release(self, samples) -> int:
        """Rank 0: forget the reward calls of samples that will not be scored (any thread); the number released."""
        calls = [c for s in samples if s is not None and (c := self._pending.pop(id(s), None)) is not None]
        self.rewarder.drop([call for _, call in calls])      # one still running is ended (data/rewards.py)
        return len(calls)

    def pending(self) -> int:
        """Reward calls submitted and not yet collected or released."""
        return len(self._pending)

    def kv_snapshot(self) -> list[dict]:
        """Every engine's KV meter (rollout/kv_meter.py), cumulative."""
        return [st["kv"] for st in self.engines.status()]

    def kv_step(self) -> dict:
        """KV bytes per running sequence since the last kv_step or evaluation, measured by the engines' allocators
        (time-averaged over their steps; the peak so far), averaged over the engines that ran: one status call."""
        from ..rollout.kv_meter import per_seq_bytes

        before, after = self._advance()
        per = [per_seq_bytes(b if b is not None and b["seq_steps"] <= a["seq_steps"] else None, a)  # restart: reset
               for b, a in zip(before, after) if b is None or a["seq_steps"] != b["seq_steps"]]
        if not per:
            return {}
        return {"kv_bytes_per_seq": sum(p["kv_bytes_per_seq"] for p in per) / len(per),
                "kv_peak_bytes_per_seq": max(p["kv_peak_bytes_per_seq"] for p in per)}

    def _advance(self) -> tuple[list, list]:
        """(the meters at the last mark, now); the engine steps between them are counted as training rollouts'."""
        after = self.kv_snapshot()
        before = self._kv_mark or [None] * len(after)
        self._kv_mark = after
        for b, a in zip(before, after):
            restart = b is None or b["decoded_seqs"] > a["decoded_seqs"]            # the start, or a restart
            for k in STEP_SUMS:
                self.occ[k] = self.occ.get(k, 0) + a.get(k, 0) - (0 if restart else b.get(k, 0))
        return before, after

    def occupancy(self) -> dict:
        """The engines' occupancy over the training rollouts so far: sequences decoded per engine step (steps that
        decoded any), from each engine's step outputs (rollout/kv_meter.py); engine_tokens: the tokens they
        generated; engine_decode_s: the seconds of those steps; engine_step_fit: a step's seconds as a function of
        the sequences in it (rollout/kv_meter.step_fit)."""
        self._advance()
        steps, seqs = self.occ.get("decode_steps", 0), self.occ.get("decoded_seqs", 0)
        return {"engine_occupancy": seqs / steps if steps else None, "engine_steps": steps, "engine_tokens": seqs,
                "engine_decode_s": self.occ.get("decode_s", 0.0), "engine_step_fit": step_fit(self.occ)}

    # -- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, version: int | None = None, keep: dict | None = None) -> float:
        """Held-out success rate: data.eval_samples responses per problem, sampled at the training temperature with
        seeds fixed for the run, the problems spread over the engines. version (a pin engine): every request served
        with that held version, while other requests go on. keep: as in generate."""
        from ..rollout.replicas import spread

        k = self.cfg.data.eval_samples
        if self._eval_prompts is None:
            self._eval_prompts = self.encode(self.eval_problems)

        def run(i, engine):          # a problem's k samples on one engine (its prompt computed once)
            mine = parts[i]
            out = engine.generate([self._eval_prompts[q] for q in mine for _ in range(k)],
                                  seeds=[eval_seed(self.cfg.seed, q, j) for q in mine for j in range(k)],
                                  **self.sampling(), versions=None if version is None else [version] * len(mine) * k)
            lens.extend(len(o.response) for o in out)
            probs = [self.eval_problems[q] for q in mine for _ in range(k)]
            scores = self.score(out, probs)[0]
            for p, r in zip(probs, scores):               # per data_source (a dataset mixing sources)
                hits = self.eval_by_source.setdefault(p.data_source, [0.0, 0])
                hits[0] += r
                hits[1] += 1
            return sum(scores)

        lens: list[int] = []
        self.eval_by_source: dict[str, list] = {}
        self._advance()                              # the training rollouts' steps so far counted
        parts = spread(len(self.eval_problems), len(self.engines))
        done = self.engines.map(run, [i for i, p in enumerate(parts) if p], {} if keep is None else keep)
        self._kv_mark = self.kv_snapshot()          # the next step's KV figures leave the evaluation out
        self.eval_lens = lens
        return sum(done.values()) / (len(self.eval_problems) * k)

    def eval_sources(self) -> dict[str, float]:
        """The last evaluation's success per data_source, when the held-out rows mix sources ({} otherwise)."""
        by = getattr(self, "eval_by_source", {})
        return {s: h / n for s, (h, n) in sorted(by.items())} if len(by) > 1 else {}

    def stop(self) -> None:
        self._pending.clear()
        self.rewarder.close(kill=True)
        if self.engines is not None:
            self.engines.stop()
