"""The reference run of bench grpo_hf: GRPO with LoRA in plain HF transformers + peft on one process (a args: the
bench's), from the warm-started default model on the synthetic task; held-out success against RL seconds.

    sample G responses per prompt (HF generate, temperature 1) -> score -> verl GRPO advantages -> verl PPO-clip
    loss (on-policy: one update per batch) -> AdamW on the LoRA factors (experts + attention)
"""
from __future__ import annotations

import json
import random
import sys
import time

import torch


def run(a) -> dict:
    import transformers
    from peft import LoraConfig, get_peft_model

    from ...algos import PolicyLossSettings, grpo_advantages, policy_loss
    from ...data.hf_sampling import evaluate, generate, prompt_ids, response_logprobs, score
    from ...data.task import make_split
    from ...data.warm_start import WarmStartSpec, warm_started

    torch.set_num_threads(a.threads)
    spec = WarmStartSpec()
    t_warm = time.perf_counter()
    path = a.model or str(warm_started("glm4_moe", "small", spec))
    warm_s = time.perf_counter() - t_warm
    tok = transformers.AutoTokenizer.from_pretrained(path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=True)
    torch.manual_seed(a.seed)
    model = get_peft_model(base, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.99), weight_decay=0.0)
    train, held = make_split(spec.task, "train"), make_split(spec.task, "eval")[:a.n_eval]
    rng = random.Random(f"grpo_hf:{a.seed}")
    settings = PolicyLossSettings(clip_ratio_high=0.28)

    def ev(step):
        return {"step": step, "rl_s": round(rl_s, 1), "rl_cpu_s": round(rl_cpu, 1),
                "eval_sampled": evaluate(model, tok, held, greedy=False, seed=10_000),
                "eval_greedy": evaluate(model, tok, held, greedy=True, seed=10_000)}

    rl_s = rl_cpu = 0.0
    curve, rewards = [ev(0)], []
    if not a.json:
        print(json.dumps(curve[0]), file=sys.stderr, flush=True)
    for step in range(1, a.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        problems = [train[rng.randrange(len(train))] for _ in range(a.prompts)]
        batch = [p for p in problems for _ in range(a.group)]
        prompts = prompt_ids(tok, batch)
        model.eval()
        resp = generate(model, tok, prompts, max_new_tokens=8, greedy=False, seed=a.seed * 1_000_003 + step)
        resp = [r if r else [tok.eos_token_id] for r in resp]
        r = torch.tensor(score(tok, batch, resp))
        rewards.append(r.mean().item())
        model.train()
        new, mask = response_logprobs(model, prompts, resp, tok.pad_token_id)
        adv = grpo_advantages(r, mask, [i // a.group for i in range(len(batch))])
        # one update per batch: the old policy is the current one (ratio 1, the PPO gradient is the PG gradient)
        loss, _ = policy_loss(new.detach(), new, adv, mask, settings)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rl_s += time.perf_counter() - t0
        rl_cpu += time.process_time() - c0
        last = step == a.steps or rl_s >= a.time_budget
        if step % a.eval_every == 0 or last:
            curve.append({**ev(step), "reward_mean_last": round(sum(rewards[-a.eval_every:]) /
                                                                 len(rewards[-a.eval_every:]), 3)})
            if not a.json:
                print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
        if last:
            break
    return {"model": path, "warmup_s": round(warm_s, 1), "steps": step, "rl_s": round(rl_s, 1),
            "rl_cpu_s": round(rl_cpu, 1), "threads": a.threads, "eval_start": curve[0]["eval_sampled"],
            "eval_end": curve[-1]["eval_sampled"], "eval_start_greedy": curve[0]["eval_greedy"],
            "eval_end_greedy": curve[-1]["eval_greedy"], "reward_start": rewards[0], "reward_end": rewards[-1],
            "curve": curve}
