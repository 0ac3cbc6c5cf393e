"""The GRPO run on every torchrun rank: rollout (rank 0 holds the vLLM engine, its own process), rewards, GRPO
advantages, the replayed logprob pass, mismatch diagnostics, the update, the LoRA-only refit; held-out evaluation
every `eval_every` steps. Rollout and training take turns: while one side works the other waits, and each side's
busy time is reported.

    summary = GRPORun(cfg, world_size).run()
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..megatron.parallel import init_distributed
from ..megatron.run_config import prepare_host
from .batch import policy_batch
from .config import TrainConfig
from .diagnostics import step_diagnostics
from .preflight import base_model_dir, run_config
from .reward import compute_score
from .schedule import eval_seed, prompt_indices, sample_seed
from .task import DATA_SOURCE, TaskSpec, make_split


def model_dir(cfg: TrainConfig) -> tuple[Path, dict]:
    """The checkpoint the run starts from, and its warm start: the seconds it took (measured now, or recorded when
    it was trained, if cached) and whether it was cached."""
    if cfg.model.path is not None or not cfg.model.warm_start:
        return base_model_dir(cfg), {"warmup_s": 0.0, "warmup_cached": False, "warm_start": False}
    from .warm_start import warm_started

    t0 = time.perf_counter()
    path = warm_started(cfg.model.family, cfg.model.size)
    took = time.perf_counter() - t0
    recorded = json.loads((path / "moe_lora_rl_warm_start.json").read_text())["train_wall_s"]
    cached = took < 0.5 * recorded
    return path, {"warmup_s": recorded if cached else took, "warmup_cached": cached, "warm_start": True}


def load_problems(cfg: TrainConfig):
    from .dataset import problems_from_rows, read_rows

    spec = TaskSpec(length=cfg.data.length, n_eval=cfg.data.n_eval)
    train = problems_from_rows(read_rows(cfg.data.train_file)) if cfg.data.train_file else make_split(spec, "train")
    held = problems_from_rows(read_rows(cfg.data.eval_file)) if cfg.data.eval_file else make_split(spec, "eval")
    return train, held


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class GRPORun:
    def __init__(self, cfg: TrainConfig, world_size: int):
        self.cfg, self.world = cfg, world_size
        self.rank = int(os.environ.get("RANK", "0"))
        self.out = Path(cfg.out_dir)
        self.busy = {"rollout": 0.0, "train": 0.0}
        self.engine = None
        self.engine_restarts = 0
        self._eval_prompts = None

    # -- set-up -------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        import transformers

        from ..policy.core import Policy

        cfg = self.cfg
        t0 = time.perf_counter()
        if self.rank == 0:
            self.path, self.warmup = model_dir(cfg)
        rc = run_config(cfg)
        prepare_host(rc)
        if rc.device == "cpu":                    # the ranks of this host share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        init_distributed(cfg.layout.layout(), rc)
        self.path, self.warmup = _broadcast((self.path, self.warmup) if self.rank == 0 else None)
        self.tok = transformers.AutoTokenizer.from_pretrained(self.path)
        self.train_problems, self.eval_problems = load_problems(cfg)
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
            import socket

            from ..rollout.placement import plan_placement
            from ..rollout.client import RolloutEngine

            self.out.mkdir(parents=True, exist_ok=True)
            where = plan_placement(node=self.cfg.rollout.node, gpus=self.cfg.rollout.gpus,
                                   this_host=socket.gethostname())
            self.engine = RolloutEngine.start(str(self.path), dtype=self.cfg.runtime.rollout_dtype,
                                              serving=self.cfg.serving, log_dir=self.out, seed=self.cfg.seed,
                                              placement=where)
        dist.barrier()
        if self.policy.version > 0:
            self.push()
        self.setup_s += time.perf_counter() - t0

    # -- the two sides ------------------------------------------------------------------------------------------
    def _prompts(self, problems, repeat: int) -> list[list[int]]:
        """Prompt ids of each problem (tokenised once), each repeated `repeat` times in a row."""
        from .hf_sampling import prompt_ids

        return [ids for ids in prompt_ids(self.tok, problems) for _ in range(repeat)]

    def _on_engine(self, what: str, fn):
        """fn() on rank 0's engine, its result on every rank. If the engine process died, it is restarted, the
        current adapter version pushed again (every rank takes part) and fn repeated, up to engine_restarts times."""
        from ..rollout.client import EngineDied

        for attempt in range(self.cfg.engine_restarts + 1):
            result = None
            if self.rank == 0:
                try:
                    result = ("ok", fn())
                except EngineDied as e:
                    result = ("died", " ".join(str(e).split())[:300])
                except Exception as e:  # noqa: BLE001 - every rank must learn it, or the others wait forever
                    result = ("error", e)
            kind, value = _broadcast(result)
            if kind == "ok":
                return value
            if kind == "error":
                raise value if self.rank == 0 else RuntimeError(f"rank 0 failed during {what}: {value}")
            if attempt == self.cfg.engine_restarts:
                raise RuntimeError(f"the rollout engine died during {what} {attempt + 1} times "
                                   f"(engine_restarts={self.cfg.engine_restarts}); giving up: {value}")
            self.log.note(f"rollout engine died during {what}: {value}; restarting it "
                          f"({attempt + 1}/{self.cfg.engine_restarts}), pushing adapter version "
                          f"{self.policy.version}, repeating {what}")
            self.engine_restarts += 1
            if self.rank == 0:
                self.engine.restart()
            if self.policy.version > 0:
                self.push()

    def rollout(self, step: int):
        """Every rank gets the step's samples and problems (generated on rank 0)."""
        a = self.cfg.algo
        idx = prompt_indices(len(self.train_problems), a.prompts_per_step, step, self.cfg.seed)
        problems = [self.train_problems[i] for i in idx for _ in range(a.group_size)]

        def generate():
            t0 = time.perf_counter()
            prompts = self._prompts([self.train_problems[i] for i in idx], a.group_size)
            seeds = [sample_seed(self.cfg.seed, step, i, j) for i in idx for j in range(a.group_size)]
            out = self.engine.generate(prompts, seeds=seeds, max_tokens=a.max_response_tokens,
                                       temperature=a.temperature, stop_token_ids=[self.tok.eos_token_id])
            self.busy["rollout"] += time.perf_counter() - t0
            return out

        samples = self._on_engine(f"the rollout of step {step + 1}", generate)
        group_ids = [k for k in range(len(idx)) for _ in range(a.group_size)]
        return samples, problems, group_ids

    def rewards(self, samples, problems) -> list[float]:
        return [compute_score(DATA_SOURCE, self.tok.decode(s.response, skip_special_tokens=True), p.answer)
                for s, p in zip(samples, problems)]

    def train_step(self, step: int) -> dict:
        cfg, a = self.cfg, self.cfg.algo
        arch = self.policy.arch
        samples, problems, group_ids = self.rollout(step)
        rewards = self.rewards(samples, problems)
        t0 = time.perf_counter()
        batch = policy_batch(samples, rewards, group_ids, self.tok.pad_token_id, moe_layers=self.moe_layers,
                             num_experts=arch.num_experts, topk=arch.topk, norm_by_std=a.norm_adv_by_std)
        replayed = self.policy.logprobs(batch, replay="r3")          # R3: the rollout's routes
        unreplayed = self.policy.logprobs(batch, replay="record" if cfg.replay == "r2" else "off")
        old = {"r3": replayed, "r2": unreplayed, "off": unreplayed}[cfg.replay]
        ref = self.policy.logprobs(batch, replay="r3" if cfg.replay == "r3" else "off", adapter=False).logprobs \
            if a.kl_coef > 0 else None
        upd = self.policy.update(batch, old.logprobs, replay="off" if cfg.replay == "off" else "r3",
                                 routes=unreplayed.recorded if cfg.replay == "r2" else None, ref_logprobs=ref,
                                 kl_coef=a.kl_coef, rollout_is=None if a.rollout_is == "off" else a.rollout_is,
                                 rollout_is_threshold=a.rollout_is_threshold)
        self.busy["train"] += time.perf_counter() - t0
        skipped = upd.pop("skipped")            # a non-finite grad norm: no step, the version unchanged
        pushed = 0 if skipped else self.push()  # the engine already serves this version
        diag = step_diagnostics(batch.rollout_logprobs, batch.loss_mask, replayed=replayed.logprobs,
                                unreplayed=unreplayed.logprobs, disagreement=replayed.disagreement)
        resp_len = sum(len(s.response) for s in samples) / len(samples)
        return {"reward": sum(rewards) / len(rewards), "response_len": resp_len, **upd, **diag,
                "refit_bytes": pushed, "version": self.policy.version, "samples_sha256": samples_digest(samples),
                **({"skipped": True} if skipped else {})}

    def push(self) -> int:
        """LoRA-only refit of the current version (collective); the bytes sent, on every rank."""
        t0 = time.perf_counter()
        res = self.policy.push(self.engine.transport if self.rank == 0 else None, self.policy.version)
        if self.rank == 0:
            self.busy["rollout"] += time.perf_counter() - t0
        return _broadcast(res.bytes if self.rank == 0 else None)

    def evaluate(self) -> float:
        """Held-out success rate: data.eval_samples responses per problem, sampled at the training temperature with
        seeds fixed for the run (rank 0's engine; the result on every rank)."""
        a, k = self.cfg.algo, self.cfg.data.eval_samples

        def run_eval():
            t0 = time.perf_counter()
            problems = [p for p in self.eval_problems for _ in range(k)]
            if self._eval_prompts is None:
                self._eval_prompts = self._prompts(self.eval_problems, 1)
            prompts = [ids for ids in self._eval_prompts for _ in range(k)]
            seeds = [eval_seed(self.cfg.seed, i, j) for i in range(len(self.eval_problems)) for j in range(k)]
            out = self.engine.generate(prompts, seeds=seeds, max_tokens=a.max_response_tokens,
                                       temperature=a.temperature, stop_token_ids=[self.tok.eos_token_id])
            self.busy["rollout"] += time.perf_counter() - t0
            return sum(self.rewards(out, problems)) / len(out)

        return self._on_engine("the held-out evaluation", run_eval)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def run_meta(self) -> dict:
        """What must not change across a resume (the layout may: adapters and optimizer state reshard)."""
        from dataclasses import asdict

        from ..checkpoint.store import describe_run

        return describe_run(self.path, self.policy.lora, seed=self.cfg.seed, algo=asdict(self.cfg.algo),
                            data=asdict(self.cfg.data), replay=self.cfg.replay)

    def save(self, step: int, history: list, evals: dict) -> None:
        from ..checkpoint.store import rng_state, save_checkpoint

        save_checkpoint(self.out / "checkpoints", step, self.policy.model, self.policy.optimizer,
                        run_meta=self.run_meta(), state={"step": step, "version": self.policy.version,
                                                         "rng": rng_state(), "history": history, "evals": evals})

    def resume(self) -> tuple[int, list, dict]:
        """Load the latest checkpoint (before the engine starts: a refusal starts nothing); the engine then gets
        that adapter version."""
        from ..checkpoint.store import load_checkpoint, set_rng_state

        state = load_checkpoint(self.out / "checkpoints", self.policy.model, self.policy.optimizer,
                                run_meta=self.run_meta())
        set_rng_state(state["rng"])
        self.policy.version = state["version"]
        return state["step"], state["history"], {int(k): v for k, v in state["evals"].items()}

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from .metrics import MetricsLogger, plot

        cfg = self.cfg
        self.setup()
        start, history, evals = self.resume() if cfg.resume else (0, [], {})
        self.start_engine()
        self.log = MetricsLogger(self.out, total_steps=cfg.steps, enabled=self.rank == 0,
                                 resumed_at=start if cfg.resume else None)
        if cfg.resume:
            self.log.note(f"resumed from the checkpoint of step {start} (adapter version {self.policy.version})")
        t_rl = time.perf_counter()
        self.busy = {"rollout": 0.0, "train": 0.0}
        if 0 not in evals:
            evals[0] = self.evaluate()
            self.log.log(0, {"eval": evals[0]})
        for step in range(start, cfg.steps):
            m = self.train_step(step)
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps:
                evals[step + 1] = m["eval"] = self.evaluate()
            m["wall_s"] = time.perf_counter() - t_rl
            history.append(m)
            self.log.log(step + 1, m)
            if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                self.save(step + 1, history, evals)
        wall = time.perf_counter() - t_rl
        from ..refit.export import stream_to_peft

        stream_to_peft(self.policy.model, self.policy.arch, self.out / "adapter", base_model=str(self.path))
        summary = self.summary(history, evals, wall)
        self.log.close()
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            plot(self.out / "metrics.jsonl", self.out / "metrics.png",
                 title=f"GRPO, {summary['layout']}, replay={cfg.replay}, serving={cfg.serving}")
            self.engine.stop()
        return summary

    def summary(self, history: list[dict], evals: dict, wall: float) -> dict:
        def mean(key, rows):
            vals = [r[key] for r in rows if key in r]
            return sum(vals) / len(vals) if vals else None

        k = min(5, len(history))
        return {"wall_s": wall, **self.warmup, "setup_s": self.setup_s,
                "reward_start": mean("reward", history[:k]), "reward_end": mean("reward", history[-k:]),
                "eval_start": evals[0], "eval_end": evals[max(evals)], "evals": evals,
                "kl_mean_r3": mean("r3_kl", history), "kl_mean_no_r3": mean("no_r3_kl", history),
                "ratio_gt2": mean("r3_ratio_gt2", history), "ratio_gt5": mean("r3_ratio_gt5", history),
                "ratio_gt2_no_r3": mean("no_r3_ratio_gt2", history),
                "disagreement_mean": mean("disagreement", history),
                "refit_bytes_per_step": mean("refit_bytes", history), "full_bytes": self.full_bytes(),
                "rollout_busy_frac": self.busy["rollout"] / wall, "train_busy_frac": self.busy["train"] / wall,
                "steps": len(history), "engine_restarts": self.engine_restarts, "replay": self.cfg.replay, "serving": self.cfg.serving,
                "layout": self.cfg.layout.layout().name, "model": str(self.path)}

    def full_bytes(self) -> int:
        """What a full-weight refit would send: every parameter of the checkpoint at the serving dtype."""
        from safetensors import safe_open

        per = 2 if self.cfg.runtime.rollout_dtype == "bfloat16" else 4
        n = 0
        for f in sorted(Path(self.path).glob("*.safetensors")):
            with safe_open(f, "pt") as h:
                n += sum(_numel(h.get_slice(k).get_shape()) for k in h.keys())
        return n * per


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def samples_digest(samples) -> str:
    """sha256 of the step's prompts and sampled tokens, in order (equal runs draw equal samples)."""
    import hashlib

    h = hashlib.sha256()
    for smp in samples:
        h.update(json.dumps([list(smp.prompt), list(smp.response)]).encode())
    return h.hexdigest()
