"""Run as a script: load a checkpoint in vLLM CPU (fp32, in-process engine), greedy-decode fixed prompts, and
compare tokens and per-token logprobs with HF transformers. Prints one JSON line."""
import json
import os
import sys

PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9], [300, 2, 41, 41, 41, 200, 11]]


def main(path: str) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0, logprobs=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    same, worst = True, 0.0
    for p, o in zip(PROMPTS, outs):
        toks = list(o.outputs[0].token_ids)
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
        same &= toks == ref
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + toks])).logits[0].float(), -1)
        for i, (t, d) in enumerate(zip(toks, o.outputs[0].logprobs)):
            worst = max(worst, abs(d[t].logprob - lp[len(p) - 1 + i, t].item()))
    return {"greedy_equal": same, "logprob_max_diff": worst}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])))
