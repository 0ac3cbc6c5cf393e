"""TRL's GRPOTrainer with a PEFT LoRA on our task, with our main job's settings: run in TRL's environment
(bench/runners/trl_env.py) by bench peers.

    .venv-trl/bin/python -m moe_lora_rl.bench.runners.trl_grpo --model DIR --lora-config adapter_config.json --out DIR
        [--steps 80] [--prompts-per-step 8] [--group-size 8] [--lr 1e-3] [--task sort|sort_trace] [--seed 0]

The LoRA is the one our main job exports (its adapter_config.json: rank, alpha, attention target_modules and the
experts' fused target_parameters), initialised by PEFT. Prompts are our chat-templated prompt ids, handed to TRL as
their text (checked to tokenize back to the same ids). The algorithm is our main job's: GRPO advantages normalised by
the group's std, PPO clip 0.2 / 0.28, token-mean ("dapo" in TRL), no KL, AdamW betas 0.9 / 0.99, no weight decay,
constant lr, grad clip 1.0, one update per rollout batch, temperature 1. Generation: transformers' generate on the
trained fp32 model (TRL's vLLM integration needs CUDA). Writes OUT/adapter (PEFT) and OUT/summary.json (wall time of
training, samples, the reward curve, versions, settings).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.bench.runners.trl_grpo")
    ap.add_argument("--model", required=True)
    ap.add_argument("--lora-config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--task", default="sort", help="the peers' task (bench/runners/peer_task.py): its problems and the most "
                    "response tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=0,
                    help="the PEFT adapter every N steps (OUT/trainer/checkpoint-N)")
    a = ap.parse_args(argv)

    import datasets
    import peft
    import torch
    import transformers
    import trl

    from ...data.prompting import encode_prompts
    from ...data.reward import compute_score
    from ...data.task import make_split
    from .peer_task import peer_task

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    spec, max_tokens, _ = peer_task(a.task)
    problems = make_split(spec, "train")
    ids = encode_prompts(tok, problems[:64], "chat")
    texts = [tok.decode(i) for i in ids]
    for t, i in zip(texts, ids):
        if tok(t, add_special_tokens=False)["input_ids"] != i:
            print(f"trl: the prompt {t!r} does not tokenize back to our prompt ids", file=sys.stderr)
            return 2
    rows = {"prompt": [], "answer": [], "data_source": []}
    for p, i in zip(problems, encode_prompts(tok, problems, "chat")):
        rows["prompt"].append(tok.decode(i))
        rows["answer"].append(p.answer)
        rows["data_source"].append(p.data_source)
    data = datasets.Dataset.from_dict(rows)

    def reward(prompts, completions, answer, data_source, **_):
        return [compute_score(d, c, g) for c, g, d in zip(completions, answer, data_source)]

    lcfg = json.loads(Path(a.lora_config).read_text())
    lora = peft.LoraConfig(r=lcfg["r"], lora_alpha=lcfg["lora_alpha"], lora_dropout=0.0, bias="none",
                           target_modules=lcfg["target_modules"], target_parameters=lcfg.get("target_parameters"),
                           task_type="CAUSAL_LM")
    batch = a.prompts_per_step * a.group_size
    cfg = trl.GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=a.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_generations=a.group_size, learning_rate=a.lr, adam_beta1=0.9,
        adam_beta2=0.99, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
        temperature=1.0, top_p=1.0, top_k=0, max_completion_length=max_tokens, seed=a.seed, use_cpu=True,
        bf16=False, fp16=False, logging_steps=1,
        save_strategy="steps" if a.save_every else "no", save_steps=a.save_every or 500, save_only_model=True,
        report_to="none", disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32})
    trainer = trl.GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=data,
                              processing_class=tok, peft_config=lora)
    trainable = {n: p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad}
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.model.save_pretrained(str(out / "adapter"))
    logs = [h for h in trainer.state.log_history if "reward" in h]
    summary = {"wall_s": wall, "steps": trainer.state.global_step, "samples": trainer.state.global_step * batch,
               "reward_curve": [float(h["reward"]) for h in logs],
               "step_times": [float(h["step_time"]) for h in logs if "step_time" in h],
               "trainable_params": sum(trainable.values()),
               "trainable_expert_params": sum(v for n, v in trainable.items() if ".experts." in n),
               "versions": {"trl": trl.__version__, "peft": peft.__version__,
                            "transformers": transformers.__version__, "torch": torch.__version__},
               "settings": {"steps": a.steps, "prompts_per_step": a.prompts_per_step, "group_size": a.group_size,
                            "lr": a.lr, "task": a.task, "max_completion_length": max_tokens, "seed": a.seed,
                            "threads": a.threads, "loss_type": "dapo", "epsilon": [0.2, 0.28], "beta": 0.0,
                            "generation": "transformers generate (fp32)", "lora": {k: lcfg.get(k) for k in (
                                "r", "lora_alpha", "target_modules", "target_parameters")}}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
