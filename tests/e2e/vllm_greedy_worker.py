"""Run as a script: load a checkpoint in vLLM CPU (fp32, in-process engine), greedy-decode fixed prompts, and
compare tokens and per-token logprobs with HF transformers; then on the same engine (prefix caching on) an adapter
version number after a clear (tests/kit/version_reuse.py). Prints one JSON line."""
import json
import sys

PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9], [300, 2, 41, 41, 41, 200, 11]]


def main(path: str) -> dict:
    from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env

    set_engine_env()
    import torch
    import transformers
    from vllm import SamplingParams

    from moe_lora_rl.rollout.generate import captured_generate

    llm = make_engine(path, dtype="float32", max_model_len=256)
    gens = captured_generate(llm, PROMPTS, SamplingParams(max_tokens=8, temperature=0, logprobs=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    same, worst = True, 0.0
    for g in gens:
        p, toks = g.prompt, g.response
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        same &= toks == ref
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)
        for i, (t, e) in enumerate(zip(toks, g.logprobs)):
            worst = max(worst, abs(e - lp[len(p) - 1 + i, t].item()))
    from kit.version_reuse import version_reuse_check

    return {"greedy_equal": same, "logprob_max_diff": worst, "version_reuse": version_reuse_check(llm, str(path))}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])))
