"""The GRPO run on every torchrun rank: rollout (rank 0 holds the vLLM engine, its own process; rl/producer.py),
rewards, the trainer step (rl/trainer_step.py), the LoRA-only refit; held-out evaluation every `eval_every` steps;
checkpoints. One loop for every mode (GRPORun.loop): each step takes its groups from a rollout source
(rl/source.py: mode=sync generates them now; rl/async_source.py: mode=async's producer keeps generating ahead),
trains on them, pushes the new version and records the step; rl/modes.py gives the run its mode's source:

    summary = GRPORun(cfg, world_size, source=SyncSource).run()        # run_class(cfg)(cfg, world_size).run()
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..megatron.parallel import from_rank0, init_distributed
from ..megatron.run_config import prepare_host
from .batching import policy_batch
from .config import TrainConfig
from .config.preflight import run_config
from ..data.prompting import resolve_template
from .groups import group_plan
from .inputs import load_problems, model_dir
from .recovery import EngineRecovery, broadcast
from .run_checkpoints import RunCheckpoints
from .samples import samples_digest, token_versions
from .source import SyncSource
from .summary import length_percentiles
from .survivor import _Survivor, _died


class GRPORun(RunCheckpoints, EngineRecovery):
    """A run of one policy: its pieces (set-up, the engine and its recovery, the trainer step, the push, evaluation,
    checkpoints, the summary) and the loop over its rollout source."""

    owner: str | None = None          # the policy's name on an engine several policies share (rl/policies_run.py)

    def engine_version(self) -> int:
        """The engine's number of the policy's current adapter version (a run of one policy: the same)."""
        return self.policy.version

    def serving_version(self) -> int | None:
        """The version requests are pinned to (None: the engine's newest, a run of one policy)."""
        return None

    def __init__(self, cfg: TrainConfig, world_size: int, source=SyncSource):
        """source: the rollout source's class, called as source(run, the resumed state) once the engines serve."""
        self.cfg, self.world, self.source_class = cfg, world_size, source
        self.rank = int(os.environ.get("RANK", "0"))
        self.out = Path(cfg.out_dir)
        self.busy = {"rollout": 0.0, "train": 0.0}
        self.prod = None
        self.engine_restarts = 0
        self.served = None                # keep_served (rank 0): rl/served.py's record of what was trained on
        if self.rank == 0 and cfg.keep_served:
            from .served import ServedAdapters

            self.served = ServedAdapters(self.out, keep=cfg.max_staleness + 1)

    # -- set-up -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        import transformers

        from ..policy.core import Policy
        from .producer import Producer

        cfg = self.cfg
        t0 = time.perf_counter()
        rc = run_config(cfg)
        prepare_host(rc)
        init_distributed(cfg.layout.layout(), rc)
        # rank 0 builds (or finds) the warm start, with the process group up: the other ranks wait without its
        # 10-minute timeout, and learn a failure as one line
        self.path, self.warmup = from_rank0(lambda: model_dir(cfg), "build the run's model (its warm start)")
        if rc.device == "cpu":                    # the ranks of this host share its cores
            cores = len(os.sched_getaffinity(0))  # those this process may use (taskset), not the machine's
            torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        self.tok = transformers.AutoTokenizer.from_pretrained(self.path)
        self.template = resolve_template(self.tok, cfg.data.prompt_template, where=str(self.path))
        self.train_problems, self.eval_problems, self.filtered = load_problems(cfg, self.tok, self.template)
        self.prod = Producer(cfg, self.tok, self.path, self.train_problems, self.eval_problems, self.out,
                             template=self.template)
        a = cfg.algo
        self.policy = Policy(str(self.path), cfg.layout.layout(), rc, cfg.lora.lora_config(init_seed=cfg.seed),
                             lr=a.lr, weight_decay=a.weight_decay, grad_clip=a.grad_clip,
                             loss=a.policy_loss_settings(), micro_batch_size=a.micro_batch_size,
                             temperature=a.temperature, betas=tuple(a.betas))
        arch = self.policy.arch
        self.moe_layers = tuple(i for i, m in enumerate(arch.moe_layers) if m)
        self.setup_s = time.perf_counter() - t0

    def start_engine(self) -> None:
        """The rollout engine (rank 0 starts its process), serving the policy's current adapter version."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.prod.start()
        dist.barrier()
        if self.policy.version > 0:
            self.push()
        self.setup_s += time.perf_counter() - t0

    @property
    def engines(self):
        """rank 0's engine replicas (rollout/replicas.py)."""
        return self.prod.engines if self.prod is not None else None

    def plans(self, step: int):
        """The GroupPlans of a step in the synchronous order."""
        p = self.cfg.algo.prompts_per_step
        return [self.group(g) for g in range(step * p, step * p + p)]

    def group(self, g: int):
        a = self.cfg.algo
        return group_plan(len(self.train_problems), a.prompts_per_step, a.group_size, self.cfg.seed, g)

    # -- the trainer side ---------------------------------------------------------------------------------------
    def train(self, samples, plans) -> tuple[dict, object, torch.Tensor]:
        """One update on whole groups (every rank); its metrics, the batch and the proximal logprobs."""
        from .trainer_step import train_on

        a, arch = self.cfg.algo, self.policy.arch
        problems, group_ids = self.prod.labels(plans)
        rewards, reward_figures = self.scored(samples, problems)
        t0 = time.perf_counter()
        batch = policy_batch(samples, rewards, group_ids, self.tok.pad_token_id, moe_layers=self.moe_layers,
                             num_experts=arch.num_experts, topk=arch.topk, norm_by_std=a.norm_adv_by_std,
                             with_kv=self.cfg.rollout.kv_replay)
        every = self.cfg.free_routing_every                   # counted in steps of the synchronous order
        m, skipped, proximal = train_on(self.policy, self.cfg, batch,
                                        free_routing=bool(every) and plans[-1].step % every == 0)
        if self.cfg.delay.train_s:
            time.sleep(self.cfg.delay.train_s)
        self.busy["train"] += time.perf_counter() - t0
        resp_len = sum(len(s.response) for s in samples) / len(samples)
        return {"reward": sum(rewards) / len(rewards), **reward_figures, "response_len": resp_len,
                **length_percentiles([len(s.response) for s in samples], "response_len_"), **m,
                **({"skipped": True} if skipped else {})}, batch, proximal

    def scored(self, samples, problems) -> tuple[list[float], dict]:
        """Every rank: the samples' rewards (rank 0's reward workers, data/rewards.py) and their figures: the mean of
        each extra key a dict reward returns (reward_extra/KEY) and, when the batch mixes data sources, the mean
        reward per source (reward/SOURCE). A bad reward call: ValueError (one line) on every rank."""
        from .metrics import reward_figures

        res = None
        if self.rank == 0:
            try:
                scores, extras = self.prod.score(samples, problems)
                res = ("ok", (scores, reward_figures(scores, extras, [p.data_source for p in problems])))
            except ValueError as e:
                res = ("error", str(e))
        kind, value = broadcast(res)
        if kind == "error":
            raise ValueError(value)
        return value

    def push(self, restarts: bool = True, after_restart=None, engines=None) -> int:
        """LoRA-only refit of the current version to every engine (or those listed), collective; the bytes sent
        per engine, on every rank. An engine that dies during the push is restarted and the version pushed to every
        engine that does not serve it yet (an open stage of it is replaced); restarts=False: the caller restarts."""
        from ..rollout.client import EngineDied

        t0 = time.perf_counter()
        tr = _Survivor(self.transport(engines)) if self.rank == 0 else None
        result = None
        try:
            res = self.policy.push(tr, self.engine_version(), owner=self.owner)
            if self.rank == 0:
                result = ("ok", res.bytes)
        except EngineDied as e:               # the begin's failure reaches every rank; the rest only rank 0
            result = _died(e)
        except Exception as e:  # noqa: BLE001 - e.g. a refused commit on rank 0: every rank must learn it
            result = ("error", e)
        if self.rank == 0:
            self.busy["rollout"] += time.perf_counter() - t0
        kind, value = broadcast(result)
        if kind == "ok":
            return value
        if kind == "error":
            raise value if self.rank == 0 else RuntimeError(f"rank 0 failed to push version "
                                                            f"{self.policy.version}: {value}")
        if not restarts:
            raise RuntimeError(f"the rollout engine died again while version {self.policy.version} was pushed "
                               f"to the restarted engine: {value[0]}")
        return self._restart(f"the push of version {self.policy.version}", value, 0, after_restart)  # it pushes

    def transport(self, engines=None):
        tr = self.engines.transport(engines)
        return tr if self.served is None else self.served.wrap(tr)

    def evaluate(self, version: int | None = None, after_restart=None) -> float:
        """Held-out success rate (Producer.evaluate on rank 0; the result on every rank). An engine's death repeats
        only that engine's share."""
        keep: dict = {}

        def run_eval():
            t0 = time.perf_counter()
            out = self.prod.evaluate(self.serving_version() if version is None else version, keep)
            self.eval_s += time.perf_counter() - t0
            self.busy["rollout"] += time.perf_counter() - t0
            return out

        out = self._on_engine("the held-out evaluation", run_eval, after_restart)
        if self.rank == 0:
            self.eval_lens = list(self.prod.eval_lens)
        return out

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        self.setup()
        try:
            start, history, evals, state = self.open()
            self.start_engine()
            self.begin(evals)
            if self.rank == 0 and any(self.filtered.values()):
                self.log.note("data.filter_overlong_prompts: left out " + ", ".join(
                    f"{n} {k} prompts" for k, n in self.filtered.items()) + f" over data.max_prompt_length="
                    f"{self.cfg.data.max_prompt_length} tokens")
            self.source = self.source_class(self, state)
            self.loop(self.source, start, history, evals)
            wall = time.perf_counter() - self.t_rl
            return self.finish(history, evals, wall)
        finally:                              # a refused input stops the engines and the reward workers too
            if self.rank == 0 and self.prod is not None:
                self.prod.stop()

    def open(self) -> tuple[int, list, dict, dict]:
        """Resume (or not) and open the metrics log: (start step, history, evals, saved state)."""
        from .metrics import MetricsLogger

        self.resuming = self.resumes()
        start, history, evals, state = self.resume() if self.resuming else (0, [], {}, {})
        self.log = MetricsLogger(self.out, total_steps=self.cfg.steps, enabled=self.rank == 0,
                                 resumed_at=start if self.resuming else None)
        self.start = start
        return start, history, evals, state

    def begin(self, evals: dict) -> None:
        """Once the engines serve this policy: the notes, the clocks, the first evaluation (none on a resume)."""
        cfg, start = self.cfg, self.start
        if self.resuming:
            self.log.note(f"resumed from the checkpoint of step {start} (adapter version {self.policy.version}, "
                          f"{self.out / 'checkpoints'}, resume={str(cfg.resume).lower()})")
        elif cfg.resume == "auto":
            self.log.note(f"resume=auto: no checkpoint in {self.out / 'checkpoints'}; starting fresh")
        if cfg.data.prompt_template == "auto" and self.template == "plain":
            self.log.note(f"the tokenizer of {self.path} has no chat template: prompts use the plain template "
                          "(data.prompt_template=auto; set it to plain to silence this)")
        self.t_rl = time.perf_counter()
        self.busy = {"rollout": 0.0, "train": 0.0}
        self.eval_s = 0.0
        self.eval_lens, self.start_lens = [], {}     # start_lens: the first evaluation's (none on a resume)
        if 0 not in evals:
            evals[0] = self.evaluate()
            self.start_lens = length_percentiles(self.eval_lens, "len_")
            self.start_sources = self.eval_sources()
            self.log.log(0, {"eval": evals[0], **self.start_sources,
                             **length_percentiles(self.eval_lens, "eval_len_")})

    def eval_sources(self) -> dict:
        """Rank 0: the last evaluation's success per data_source ("eval/SOURCE"), when the held-out rows mix
        sources."""
        if self.rank != 0:
            return {}
        from .metrics import BY_SOURCE, EVAL_SUCCESS

        return {f"{BY_SOURCE[EVAL_SUCCESS]}{k}": v for k, v in self.prod.eval_sources().items()}

    def export_adapter(self) -> None:
        """Collective: the trained adapter as a PEFT directory, out_dir/adapter."""
        from ..refit.export import stream_to_peft

        stream_to_peft(self.policy.model, self.policy.arch, self.out / "adapter", base_model=str(self.path))

    def finish(self, history: list, evals: dict, wall: float) -> dict:
        """After the last step: the dense evaluation (sparse rollouts), the PEFT adapter, summary.json, the plot."""
        from .metrics import plot

        cfg = self.cfg
        eval_dense = self.dense_eval() if cfg.rollout.kv_compression != "none" else None
        self.export_adapter()
        summary = self.summary(history, evals, wall)
        if eval_dense is not None:
            summary["eval_end_dense"] = eval_dense
            self.log.note(f"the final adapter on dense engines (KV uncompressed): held-out success {eval_dense:.3f}")
        self.log.close()
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            plot(self.out / "metrics.jsonl", self.out / "metrics.png",
                 title=f"GRPO {cfg.mode}, {summary['layout']}, replay={cfg.replay}, serving={cfg.serving}"
                 + (f", policy {self.owner}" if self.owner else ""))
        return summary

    def dense_eval(self) -> float:
        """Every rank: the trained adapter's held-out success with the KV cache uncompressed (a run on sparse
        rollouts is judged as it will be served: densely). Rank 0 restarts its engines without compression, the
        current version is pushed to them, the evaluation runs as every other (same seeds); the engines stay dense."""
        if self.rank == 0:
            for e in self.engines:
                e.settings.update(kv_compression="none", kv_budget=0, kv_evict={}, kv_replay=False,
                                  prefix_caching=True)
                e.restart()
        self.push(restarts=False)
        return self.evaluate()

    def eval_due(self, step: int) -> bool:
        """Evaluate after `step` updates?"""
        cfg = self.cfg
        return bool(cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps

    def checkpoint_due(self, step: int) -> bool:
        cfg = self.cfg
        return bool(cfg.checkpoint_every) and (step % cfg.checkpoint_every == 0 or step == cfg.steps)

    def loop(self, source, start: int, history: list, evals: dict) -> None:
        """Every mode's loop: each step trains on the source's groups, pushes the new version and is recorded."""
        with source:
            for step in range(start, self.cfg.steps):
                self.record(step, self.update(step, source), history, evals, source)

    def update(self, step: int, source) -> dict:
        """One step: the source's groups, the update on them (every rank), the push; the step's metrics."""
        t0 = time.perf_counter()
        got = source.take(step)
        t1 = time.perf_counter()
        m, batch, proximal = self.train(got.samples, got.plans)
        if self.served is not None:
            self.served.record(step + 1, got.samples)
        t2 = time.perf_counter()
        pushed = 0
        if not m.get("skipped"):              # else the engine already serves this version
            pushed = self.push(after_restart=source.recover)    # async: in flight, the engine keeps generating
            source.pushed()
        return {**m, **source.figures(got, batch, proximal), "refit_bytes": pushed, "version": self.policy.version,
                "time_rollout_s": t1 - t0, "time_train_s": t2 - t1, "time_push_s": time.perf_counter() - t2,
                "samples_sha256": samples_digest(got.samples), "rollout_versions": token_versions(got.samples)}

    def record(self, step: int, m: dict, history: list, evals: dict, source) -> None:
        """A finished step (every mode): the evaluation if due, the clocks, the metrics line, the checkpoint if due."""
        if step + 1 == self.cfg.steps:
            source.last()
        if self.eval_due(step + 1):
            evals[step + 1] = m["eval"] = self.evaluate(source.eval_version(), after_restart=source.recover)
            m.update(self.eval_sources())
            m.update(length_percentiles(self.eval_lens, "eval_len_"))
        m["wall_s"] = time.perf_counter() - self.t_rl
        m["eval_s"] = self.eval_s             # seconds of evaluation so far (in wall_s)
        history.append(m)
        self.log.log(step + 1, m)
        self.stepped(step)
        if self.checkpoint_due(step + 1):
            self.save(step + 1, history, evals, **source.state())

    def stepped(self, step: int) -> None:
        """A step finished: the first after a resume clears the resume's mark (checkpoint/attempts.py)."""
        if self.resuming and step == self.start and self.rank == 0:
            from ..checkpoint.api import resume_succeeded

            resume_succeeded(self.out / "checkpoints")

    def summary(self, history: list[dict], evals: dict, wall: float) -> dict:
        from .summary import run_summary

        return {**run_summary(self, history, evals, wall), **self.source.summary(history)}
