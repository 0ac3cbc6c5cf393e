"""The rollout side of a run, on rank 0: the engine process, prompts, whole GRPO groups, rewards and the held-out
evaluation. Every rank has one (labels and rewards are computed everywhere); the engine lives on rank 0. Both
loops use it: the synchronous one asks for a step's groups and waits; the asynchronous one
(rl/pipeline.py) streams groups while the trainer works.

    prod = Producer(cfg, tok, path, train_problems, eval_problems, out_dir); prod.start()
    samples = prod.generate(plans); problems, group_ids = prod.labels(plans)   # plans: group_plan(...) of step s
    prod.evaluate(version=None) -> held-out success;  prod.rewards(samples, problems)
"""
from __future__ import annotations

from pathlib import Path

from .groups import GroupPlan
from .reward import compute_score
from .schedule import eval_seed
from .task import DATA_SOURCE


class Producer:
    def __init__(self, cfg, tok, path, train_problems, eval_problems, out_dir):
        self.cfg, self.tok, self.path = cfg, tok, Path(path)
        self.train_problems, self.eval_problems = train_problems, eval_problems
        self.out = Path(out_dir)
        self.engine = None
        self._prompt_cache: dict[int, list[int]] = {}
        self._eval_prompts = None

    def start(self) -> None:
        import socket

        from ..rollout.client import RolloutEngine
        from ..rollout.placement import plan_placement

        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        where = plan_placement(node=cfg.rollout.node, gpus=cfg.rollout.gpus, this_host=socket.gethostname())
        kw = {"step_delay_s": cfg.delay.engine_step_s}
        if cfg.mode == "async":          # the engine keeps generating while versions change
            kw |= {"inflight": cfg.inflight, "on_full": "wait",
                  "max_versions": cfg.max_staleness + 1 if cfg.inflight == "pin" else None}
        self.engine = RolloutEngine.start(str(self.path), dtype=cfg.runtime.rollout_dtype, serving=cfg.serving,
                                          log_dir=self.out, seed=cfg.seed, placement=where, **kw)

    # -- prompts and groups -------------------------------------------------------------------------------------
    def prompt(self, problem: int) -> list[int]:
        """The prompt ids of a training problem (tokenised once)."""
        from .hf_sampling import prompt_ids

        if problem not in self._prompt_cache:
            self._prompt_cache[problem] = prompt_ids(self.tok, [self.train_problems[problem]])[0]
        return self._prompt_cache[problem]

    def requests(self, plans: list[GroupPlan]) -> dict:
        """The engine requests of whole groups, in order: prompts and seeds."""
        g = self.cfg.algo.group_size
        return {"prompts": [self.prompt(p.problem) for p in plans for _ in range(g)],
                "seeds": [s for p in plans for s in p.seeds]}

    def sampling(self) -> dict:
        a = self.cfg.algo
        return {"max_tokens": a.max_response_tokens, "temperature": a.temperature,
                "stop_token_ids": [self.tok.eos_token_id]}

    def generate(self, plans: list[GroupPlan]):
        """The samples of whole groups, in order (waiting for all)."""
        return self.engine.generate(**self.requests(plans), **self.sampling())

    def labels(self, plans: list[GroupPlan]):
        """The problem and the group id (position in `plans`) of each sample of whole groups (any rank)."""
        g = self.cfg.algo.group_size
        problems = [self.train_problems[p.problem] for p in plans for _ in range(g)]
        return problems, [k for k in range(len(plans)) for _ in range(g)]

    def rewards(self, samples, problems) -> list[float]:
        return [compute_score(DATA_SOURCE, self.tok.decode(s.response, skip_special_tokens=True), p.answer)
                for s, p in zip(samples, problems)]

    # -- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, version: int | None = None) -> float:
        """Held-out success rate: data.eval_samples responses per problem, sampled at the training temperature with
        seeds fixed for the run. version (a pin engine): every request served with that held version, while other
        requests go on."""
        from .hf_sampling import prompt_ids

        k = self.cfg.data.eval_samples
        problems = [p for p in self.eval_problems for _ in range(k)]
        if self._eval_prompts is None:
            self._eval_prompts = prompt_ids(self.tok, self.eval_problems)
        prompts = [ids for ids in self._eval_prompts for _ in range(k)]
        seeds = [eval_seed(self.cfg.seed, i, j) for i in range(len(self.eval_problems)) for j in range(k)]
        out = self.engine.generate(prompts, seeds=seeds, **self.sampling(),
                                   versions=None if version is None else [version] * len(prompts))
        return sum(self.rewards(out, problems)) / len(out)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()
