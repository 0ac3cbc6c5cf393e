"""Everything the run can refuse before a process group or an engine starts (ValueError naming the value):
the layout against the world size and the model, the replay mode against the model, the data (parsed by the
config), the model directory."""
from __future__ import annotations

from pathlib import Path

from ...megatron.build import check_layout
from ...models.arch import load_arch
from ...megatron.run_config import RunConfig
from . import TrainConfig
from ..inputs import base_model_dir

TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def run_config(cfg: TrainConfig) -> RunConfig:
    return RunConfig(device=cfg.runtime.device, dtype=TORCH_DTYPES[cfg.runtime.train_dtype],
                     grouped_experts=cfg.runtime.experts == "grouped")


def check(cfg: TrainConfig, world_size: int, prompt_rows: int = 0):
    """The run's architecture, once every check passed; prompt_rows > 0: the first prompt_rows prompts of each split
    measured against data.max_prompt_length too (the launcher's MEASURED_ROWS; each rank measures as it goes)."""
    layout = cfg.layout.layout()
    layout.check_world_size(world_size)
    arch = load_arch(base_model_dir(cfg))
    check_layout(arch, layout)
    if arch.tie_embeddings and layout.pp > 1:
        raise ValueError(f"layout.pp={layout.pp}: the model ties its input and output embeddings; use pp=1")
    if cfg.runtime.experts == "grouped":
        from ...megatron.cpu_support import mcore_version

        if not mcore_version().startswith("0.16."):
            raise ValueError(f"runtime.experts=grouped: megatron-core {mcore_version()} has no legacy GroupedMLP; "
                             "use runtime.experts=sequential")
        if cfg.runtime.device == "cuda" and cfg.runtime.train_dtype != "bfloat16":
            raise ValueError(f"runtime.experts=grouped with runtime.train_dtype={cfg.runtime.train_dtype}: the "
                             "grouped_gemm kernel on cuda is bf16-only")
    if cfg.rollout.kv_compression != "none":          # the model's attention must be one the engine can window
        import json

        from ...rollout.client import DEFAULT_MAX_MODEL_LEN
        from ...rollout.kv_compression import check_compression

        check_compression(cfg.rollout.kv_compression, cfg.rollout.kv_budget, DEFAULT_MAX_MODEL_LEN,
                          json.loads((base_model_dir(cfg) / "config.json").read_text()), cfg.rollout.evict())
    if cfg.replay != "off" and not any(arch.moe_layers):
        raise ValueError(f"replay={cfg.replay!r}: the model has no MoE layer to replay routes in; use replay=off")
    n = cfg.algo.group_size * cfg.algo.prompts_per_step
    dp = world_size // (layout.tp * layout.pp)
    if n % dp:
        raise ValueError(f"algo.group_size*prompts_per_step={n}: the batch of whole groups does not split over "
                         f"data-parallel size {dp} (world {world_size} / tp {layout.tp} / pp {layout.pp})")
    if n % (dp * cfg.algo.micro_batch_size):
        raise ValueError(f"algo.micro_batch_size={cfg.algo.micro_batch_size}: the batch of {n} responses does not "
                         f"split into microbatches over data-parallel size {dp}")
    m, mbs = cfg.algo.mini_batches, cfg.algo.micro_batch_size
    if m > 1 and (n // m) % (dp * mbs):        # each mini-step splits its mini-batch over dp, then into microbatches
        raise ValueError(f"algo.mini_batches={m}: a mini-batch of {n // m} responses (batch {n} / {m}) does not split "
                         f"over data-parallel size {dp} into microbatches of micro_batch_size={mbs}")
    check_prompts(cfg, prompt_rows)
    from .policy_settings import policy_configs

    for name, pcfg in policy_configs(cfg) or [(None, cfg)]:   # each policy's answers fit, its checkpoints exist
        where = "" if name is None else f"policies: {name!r}: "
        try:
            if name is not None:
                check_prompts(pcfg)
            check_targets(pcfg, arch)
            check_resumable(pcfg, lora=name is None)   # a policy's adapters: checked at its load
        except ValueError as e:
            raise ValueError(f"{where}{e}") from None
    if cfg.runtime.device == "cpu":
        if cfg.rollout.base_from != "disk" and cfg.rollout.base_transport in ("nccl", "ipc"):
            raise ValueError(f"rollout.base_transport={cfg.rollout.base_transport!r} with runtime.device=cpu: it "
                             "sends from the trainer's GPU (use gloo, http or shm on CPU)")
        check_engine_cores(cfg)
    run_config(cfg).check_host()
    return arch


def check_targets(cfg: TrainConfig, arch) -> None:
    unmatched = cfg.lora.lora_config().unmatched(arch.adaptable())
    if unmatched:
        raise ValueError(f"lora.targets {unmatched} match no layer of this model (it has {sorted(arch.adaptable())})")


def check_resumable(cfg: TrainConfig, lora: bool = True) -> None:
    """resume=true finds a checkpoint; with LORA, a checkpoint resume would load was written with compatible LoRA
    settings (checkpoint/load.py's check_resume_lora: refused before any policy is built)."""
    if not cfg.resume:
        return
    from ...checkpoint.api import check_resume_lora, resumable_step

    root = Path(cfg.out_dir) / "checkpoints"
    if cfg.resume is True and resumable_step(root) is None:
        raise ValueError(f"resume=true: no checkpoint in {str(root)!r} (run with checkpoint_every>0 first, or "
                         "resume=auto to start fresh when there is none)")
    if lora:
        check_resume_lora(root, cfg.lora.lora_config())


def check_engine_cores(cfg: TrainConfig) -> None:
    """CPU engines on rank 0's host need a core each (their threads split the cores this process may use)."""
    import os
    import socket

    from ...rollout.placement import plan_placements

    here = [p for p in plan_placements(cfg.rollout.engines, nodes=cfg.rollout.node, gpus=cfg.rollout.gpus,
                                       this_host=socket.gethostname()) if p.transport == "shm"]
    cores = len(os.sched_getaffinity(0))
    if len(here) > cores:
        raise ValueError(f"rollout.engines={cfg.rollout.engines}: {len(here)} CPU engines on this host need a core "
                         f"each; this process may use {cores}")


MEASURED_ROWS = 10_000
"""Rows of a split measured before the run (tokenizing 60k chat prompts takes ~15 s of CPU): prompts by the launcher
(check(prompt_rows=)), reference answers by every check; later prompts are measured as the run reaches them, and one
over the limit stops the run with the same line (rl/producer.py)."""


def check_prompts(cfg: TrainConfig, rows: int = 0) -> None:
    """The tokenizer can make the prompts asked for and stop responses (data/prompting.py), the answers fit
    algo.max_response_tokens (check_answer_length) and, with rows > 0, the first `rows` prompts of each split fit
    data.max_prompt_length or are truncated or filtered as configured (rl/inputs.py: filtering measures every row).
    One tokenizer load for all of it."""
    import transformers

    from ...data.prompting import check_tokenizer, resolve_template

    where = str(base_model_dir(cfg))
    tok = transformers.AutoTokenizer.from_pretrained(where)
    template = resolve_template(tok, cfg.data.prompt_template, where=where)
    check_tokenizer(tok, where)
    check_answer_length(cfg, tok)
    if rows > 0:
        check_prompt_lengths(cfg, tok, template, rows)


def check_prompt_lengths(cfg: TrainConfig, tokenizer, template: str, rows: int = MEASURED_ROWS) -> None:
    """Every prompt of the first `rows` of a split fits data.max_prompt_length (data.truncation=error without
    filtering; ValueError naming the split, the row and its data_source), else nothing to measure here."""
    from ..inputs import load_problems
    from ...data.prompting import fit_prompt, prompt_lengths

    d = cfg.data
    for split, examples in zip(("train", "val"), load_problems(cfg, tokenizer, template)[:2]):
        if d.truncation == "error" and not d.filter_overlong_prompts:
            examples = examples[:rows]
            for e, n in zip(examples, prompt_lengths(tokenizer, examples, template)):
                fit_prompt([0] * n, d.max_prompt_length, d.truncation,
                           f"{split} row {e.index} (data_source {e.data_source!r})")


def check_answer_length(cfg: TrainConfig, tokenizer) -> None:
    """algo.max_response_tokens holds the longest answer the warm start teaches (a cut answer can never be
    rewarded): the generated task's longest answer and its end of turn (every digit is one token, so the longest
    list's), or, for a dataset warm-started on data.reference_key, the longest reference answer of the first
    MEASURED_ROWS training rows (its reward reads the decoded text, so the end of turn may be cut; ValueError naming
    the row). A dataset without a warm start (no reference column, model.path, model.warm_start=false) has no
    answer length to hold."""
    d = cfg.data
    if d.train_files is not None:
        if d.reference_key is None or cfg.model.path is not None or not cfg.model.warm_start:
            return
        from ...data.dataset import load_examples

        examples = load_examples(d.files("train"), d.prompt_key, d.reference_key)[:MEASURED_ROWS]
        ids = tokenizer([e.reference for e in examples], add_special_tokens=False)["input_ids"]
        k = max(range(len(ids)), key=lambda i: len(ids[i]))
        need = len(ids[k])
        if cfg.algo.max_response_tokens < need:
            raise ValueError(f"algo.max_response_tokens={cfg.algo.max_response_tokens} is below the longest reference "
                             f"answer the warm start teaches (data.reference_key={d.reference_key!r}, train row "
                             f"{examples[k].index}: {need} tokens)")
        return
    from ...data.task import Problem

    spec = d.task_spec()
    n = spec.sizes()[1]
    need = len(tokenizer(Problem((1,) * n, 0, spec.kind).answer, add_special_tokens=False)["input_ids"]) + 1
    if cfg.algo.max_response_tokens < need:
        raise ValueError(f"algo.max_response_tokens={cfg.algo.max_response_tokens} is below the longest answer of "
                         f"data.task={spec.kind} ({need} tokens with the end of turn, {n} digits)")
