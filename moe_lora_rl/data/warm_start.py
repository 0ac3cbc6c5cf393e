"""Supervised warm start of a built-in model on the synthetic task or on a dataset's reference answers
(data_warm_spec: data.reference_key, e.g. gsm8k's worked solutions), so RL starts from a low but non-zero success
rate in the dataset's answer format.

    path = warm_started("glm4_moe", "wide")          # the size's default_spec; HF checkpoint dir, cached like get_model
    path = warm_started("glm4_moe", "small", WarmStartSpec(steps=100))

Plain HF transformers training on CPU: fine-tuning on the training split's prompt -> answer pairs (loss on the answer
tokens and the end-of-turn token), a fixed number of steps from a fixed seed, spec.threads threads (1 by default:
deterministic anywhere; several
threads change reduction order). Every weight trains, except the routers when router_lr_scale=0; bias_update
balances the experts' load through the expert bias. The held-out split is never seen.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..models.tiny import cache_root, get_model, spec_key
from .hf_sampling import prompt_ids
from .task import Problem, TaskSpec, make_split

WARM_START_VERSION = 2


@dataclass(frozen=True)
class WarmStartSpec:
    task: TaskSpec = field(default_factory=TaskSpec)
    steps: int = 60
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20
    seed: int = 0
    router_lr_scale: float = 1.0
    """The routers' learning rate relative to lr (0: routers frozen at their initialisation)."""
    bias_update: float = 0.0
    """Aux-loss-free load balancing (DeepSeek-V3): after every step each MoE layer's expert bias moves by this much
    towards balance (down for an expert above the mean load, up below it); 0: off."""
    window: int = 0
    """With window_frac > 0: that share of the steps trains with sliding-window attention of this many tokens (each
    token sees the last `window` tokens, itself included), so the model does not depend on context a windowed KV
    cache drops (the way models with local-attention layers are pretrained); the model itself stays dense."""
    window_frac: float = 0.0
    chunks: int = 1
    """Each batch, sorted by length, runs as this many forward/backward passes of similar lengths (gradients
    accumulated, the loss weighted by answer tokens): the same loss as one padded batch, without most of its padding
    when lengths vary as much as sort_long's (70 to 400 tokens)."""
    threads: int = 1
    """torch threads while training (1: bit-reproducible anywhere; more: faster, reproducible at that count)."""
    decay: bool = False
    """After the warmup, the learning rate falls linearly to 0 at the last step (False: constant)."""
    data: tuple = ()
    """A dataset's files (verl's row format) to learn instead of the built-in task: each row's prompt -> its
    reference answer (reference_key, e.g. gsm8k's worked solution in extra_info.answer). Cached by data_digest."""
    data_digest: str = ""
    """sha256 of the files' bytes (data_digest(files)): the warm start's cache key holds it, not the paths."""
    prompt_key: str = "prompt"
    reference_key: str | None = None

    def __post_init__(self):
        for k in ("steps", "batch_size", "chunks", "threads"):
            if getattr(self, k) < 1:
                raise ValueError(f"warm start {k}={getattr(self, k)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"warm start lr={self.lr} must be > 0")
        if not 0 <= self.window_frac <= 1 or (self.window_frac > 0 and self.window < 1):
            raise ValueError(f"warm start window={self.window}, window_frac={self.window_frac}: need a fraction in "
                             "[0, 1] and, when it is > 0, a window >= 1")
        if not self.router_lr_scale >= 0 or not self.bias_update >= 0:
            raise ValueError(f"warm start router_lr_scale={self.router_lr_scale}, bias_update={self.bias_update}: "
                             "must be >= 0")

    def key(self) -> str:
        fields = asdict(self)
        for k, default in (("router_lr_scale", 1.0), ("bias_update", 0.0), ("window", 0),
                           ("window_frac", 0.0), ("chunks", 1), ("threads", 1),
                           ("decay", False)):                      # keys of earlier specs unchanged
            if fields[k] == default:
                del fields[k]
        if not fields["data"]:                              # keys of the built-in task's specs unchanged
            for k in ("data", "data_digest", "prompt_key", "reference_key"):
                del fields[k]
        else:
            del fields["data"], fields["task"]              # the dataset's bytes, wherever its files are
        if "task" not in fields:
            pass
        elif fields["task"]["kind"] == "sort":
            del fields["task"]["kind"]
        if "task" not in fields:
            pass
        elif fields["task"].get("mix") is None:
            fields["task"].pop("mix", None)
        else:                                             # a named mix and its spelling out are one warm start
            from .task import MIXES

            fields["task"]["mix"] = MIXES.get(fields["task"]["mix"], fields["task"]["mix"])
        blob = json.dumps({**fields, "v": WARM_START_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]


def data_digest(files) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def target(problem) -> str:
    """What the warm start teaches for a problem: its reference answer (a dataset's data.reference_key), else its
    ground truth (the built-in tasks: the answer is the ground truth)."""
    ref = getattr(problem, "reference", None)
    return ref if ref is not None else problem.answer


def sft_batch(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 except on the answer and its end-of-turn)."""
    prompts = prompt_ids(tokenizer, problems)
    answers = [tokenizer(target(p), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for p in problems]
    n = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(problems), n), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(problems), n), dtype=torch.long)
    labels = torch.full((len(problems), n), -100, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, :len(p) + len(a)] = 1
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    return ids, mask, labels


def window_mask(n: int, window: int | None) -> torch.Tensor:
    """[1, 1, n, n] additive attention mask: query i sees key j when j <= i and i - j < window (None: causal only;
    right padding needs nothing more: no real token sees a pad)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = (j <= i) if window is None else (j <= i) & (i - j < window)
    return torch.where(ok, 0.0, float("-inf"))[None, None]


def _sft_step(model, tokenizer, batch: list[Problem], spec: WarmStartSpec, windowed: bool, real: dict):
    """Forward and backward of one batch (spec.chunks passes of similar lengths, the loss weighted by answer
    tokens: the padded batch's mean token loss); the loss, detached."""
    if spec.chunks == 1:
        parts = [batch]
    else:
        order = sorted(batch, key=lambda p: len(target(p)))
        size = -(-len(order) // spec.chunks)
        parts = [order[i:i + size] for i in range(0, len(order), size)]
    encoded = [sft_batch(tokenizer, part) for part in parts]
    total = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in encoded)
    loss = torch.zeros(())
    for ids, mask, labels in encoded:
        real["mask"] = mask.reshape(-1).bool()
        part = model(input_ids=ids, attention_mask=window_mask(ids.shape[1], spec.window) if windowed else mask,
                     labels=labels).loss * (int((labels[:, 1:] != -100).sum()) / total)
        part.backward()
        loss += part.detach()
    return loss


def train(model, tokenizer, spec: WarmStartSpec, *, on_step=None) -> dict:
    """Run the supervised phase in place. on_step(step, loss) may evaluate; its time is not counted."""
    if spec.data:
        from .dataset import load_examples

        problems = load_examples(list(spec.data), spec.prompt_key, spec.reference_key)
    else:
        problems = make_split(spec.task, "train")
    rng = random.Random(f"warm_start:{spec.seed}")
    torch.manual_seed(spec.seed)
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    if not routers and (spec.router_lr_scale != 1.0 or spec.bias_update > 0):
        raise ValueError(f"warm start router_lr_scale={spec.router_lr_scale}, bias_update={spec.bias_update}: "
                         f"{type(model).__name__} has no router with an expert bias (DeepSeek-V3-style routing)")
    router_params = {id(m.weight) for m in routers}
    groups = [{"params": [p for p in model.parameters() if id(p) not in router_params], "lr": spec.lr}]
    if routers and spec.router_lr_scale > 0:
        groups.append({"params": [m.weight for m in routers], "lr": spec.lr * spec.router_lr_scale})
    for m in routers:
        m.weight.requires_grad_(spec.router_lr_scale > 0)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0)
    real = {}                                                      # the current batch's real-token mask
    loads, hooks = _load_counters(routers, spec.bias_update > 0, real)
    def lr_scale(s: int) -> float:
        up = min(1.0, (s + 1) / spec.warmup_steps)
        return up if not spec.decay else min(up, (spec.steps - s) / max(1, spec.steps - spec.warmup_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    model.train()
    wall = cpu = 0.0
    loss = torch.tensor(float("nan"))
    try:
        for step in range(1, spec.steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            batch = [problems[rng.randrange(len(problems))] for _ in range(spec.batch_size)]
            windowed = spec.window_frac > 0 and rng.random() < spec.window_frac
            loss = _sft_step(model, tokenizer, batch, spec, windowed, real)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            _balance(routers, loads, spec.bias_update)
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            if on_step is not None:
                on_step(step, loss.item())
    finally:
        for h in hooks:
            h.remove()
    return {"steps": spec.steps, "final_loss": loss.item(), "train_wall_s": wall, "train_cpu_s": cpu}


SIZE_WARM_STARTS = {"wide": dict(router_lr_scale=0.0, bias_update=0.01)}
"""Per built-in size, how its warm start differs from WarmStartSpec's defaults. "wide" keeps its routers at their
initialisation and balances their load with the expert bias: its routers' top-k margins stay as narrow as a
load-balanced trained router's, where bf16 rounding in the rollout flips decisions about as often as in real MoE
models (training the routers on this task sharpens them until almost nothing flips)."""


_SOFTMAX_ROUTERS = dict(router_lr_scale=1.0, bias_update=0.0)
FAMILY_WARM_STARTS = {family: _SOFTMAX_ROUTERS for family in ("qwen3_moe", "qwen3_5_moe", "qwen3_next")}
"""Per family, how its warm start differs (after the size's): the softmax routers of Qwen3-MoE and of the hybrid
family (Qwen3.5/3.6-MoE, Qwen3-Next) carry no expert bias to balance a frozen router with, so they train with the
rest, as in the models' own training."""


def default_spec(size: str, family: str | None = None) -> WarmStartSpec:
    """The warm start of a built-in size (SIZE_WARM_STARTS), and family (FAMILY_WARM_STARTS) when given."""
    return WarmStartSpec(**{**SIZE_WARM_STARTS.get(size, {}), **FAMILY_WARM_STARTS.get(family, {})})


TASK_WARM_STARTS = {"sort_trace": dict(steps=300, window=32, window_frac=0.5),
                    "sort_long": dict(steps=300, batch_size=16, chunks=4, threads=2, lr=3e-3, decay=True)}
"""Per task kind, how its warm start differs (after the size's): the written trace is a long answer, learnt in more
supervised steps, half of them with a 32-token attention window (so that rollouts on a windowed KV cache stay
usable: trained on full attention only, the model fails every trace once its first tokens leave the window).
sort_long's answers run from 70 to 400 tokens: batches of 16 in 4 length-sorted chunks (half the time of one padded
batch), on both cores (the warm start runs before any engine or trainer)."""


def task_warm_spec(size: str, task: TaskSpec, family: str | None = None) -> WarmStartSpec:
    """The warm start of a built-in size on `task` (the size's default_spec, trained on that task)."""
    base = default_spec(size, family)
    if task == base.task:
        return base
    return replace(base, task=task, **TASK_WARM_STARTS.get(task.kind, {}))


def data_warm_spec(size: str, files, prompt_key: str, reference_key: str, family: str | None = None) -> WarmStartSpec:
    """The warm start of a built-in size on a dataset: the size's default_spec, learning each training row's
    reference answer (rows read like the run's, data/dataset.py)."""
    files = tuple(str(f) for f in files)
    return replace(default_spec(size, family), data=files, data_digest=data_digest(files), prompt_key=prompt_key,
                   reference_key=reference_key)


def _load_counters(routers, on: bool, real: dict) -> tuple[list[torch.Tensor], list]:
    """Per router, a tensor counting the real tokens (real["mask"]) routed to each expert, filled by forward
    hooks in training mode; and the hooks' handles."""
    loads = [torch.zeros(m.e_score_correction_bias.numel()) for m in routers]
    hooks = []
    if not on:
        return loads, hooks
    for m, load in zip(routers, loads):
        def hook(mod, args, out, load=load):
            if not mod.training:                # an evaluation pass (on_step) is not training load
                return
            idx = out[2][real["mask"]]
            load += torch.bincount(idx.reshape(-1), minlength=load.numel()).to(load.dtype)
        hooks.append(m.register_forward_hook(hook))
    return loads, hooks


@torch.no_grad()
def _balance(routers, loads: list[torch.Tensor], speed: float) -> None:
    """DeepSeek-V3's bias update: bias_i += speed * sign(mean load - load_i); the counters restart."""
    for m, load in zip(routers, loads):
        if speed > 0 and load.sum() > 0:
            m.e_score_correction_bias += speed * torch.sign(load.mean() - load).to(m.e_score_correction_bias.dtype)
        load.zero_()


def _keep_config_keys(base: Path, out: Path) -> None:
    """The base's config.json keys that save_pretrained does not write (DeepSeek-V3's topk_method / scoring_func,
    which HF's config class drops and vLLM needs) written back, so the warm-started checkpoint is read as its base."""
    have = json.loads((out / "config.json").read_text())
    lost = {k: v for k, v in json.loads((base / "config.json").read_text()).items() if k not in have}
    if lost:
        (out / "config.json").write_text(json.dumps({**have, **lost}, indent=2, sort_keys=True) + "\n")


def warm_started(family: str = "glm4_moe", size: str = "wide", spec: WarmStartSpec | None = None,
                 model_seed: int = 0) -> Path:
    """Path of the cached warm-started checkpoint (base model get_model(family, size, model_seed)), training it
    first if needed; its moe_lora_rl_warm_start.json records the spec and the measured training time."""
    import transformers

    spec = default_spec(size, family) if spec is None else spec
    base = get_model(family, size, model_seed)
    root = cache_root()
    out = root / f"{spec_key(family, size, model_seed)}-warm-{spec.key()}"
    stamp = out / "moe_lora_rl_warm_start.json"
    if stamp.exists():
        return out
    # one lock per warm start: a long one (minutes to hours) must not hold up another model's or spec's
    with open(root / f".lock-{out.name}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            return out
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-warm-"))
        try:
            threads = torch.get_num_threads()
            torch.set_num_threads(spec.threads)
            try:
                with torch.random.fork_rng():
                    tok = transformers.AutoTokenizer.from_pretrained(base)
                    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                    info = train(model, tok, spec)
            finally:
                torch.set_num_threads(threads)
            model.save_pretrained(tmp, safe_serialization=True)
            _keep_config_keys(base, tmp)
            tok.save_pretrained(tmp)
            shutil.copy(base / "moe_lora_rl.json", tmp / "moe_lora_rl.json")
            (tmp / "moe_lora_rl_warm_start.json").write_text(json.dumps(
                {"base": str(base), "spec": asdict(spec), "version": WARM_START_VERSION, **info}, indent=1))
            os.replace(tmp, out)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return out
