"""Run in its own process: decode timings of one in-process vLLM CPU engine at several concurrencies (all requests
submitted together, fixed lengths). Prints `RESULT {json}`: per concurrency the median wall and process-CPU seconds
of a generate()."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ...rollout.vllm_engine import make_engine, set_engine_env
from ...rollout.generate import captured_generate


def main(argv=None):
    set_engine_env()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"     # one OpenMP thread (OMP_NUM_THREADS=1): CPU time = work
    import torch
    from vllm import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", required=True, help="comma-separated, e.g. 1,4,16")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--response-len", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    conc = [int(c) for c in a.concurrency.split(",")]
    llm = make_engine(a.model, max_model_len=a.prompt_len + a.response_len + 8, prefix_caching=False,
                      max_num_seqs=max(conc))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, vocab, (max(conc), a.prompt_len), generator=g).tolist()
    sp = SamplingParams(max_tokens=a.response_len, min_tokens=a.response_len, ignore_eos=True, temperature=1.0,
                        seed=1)

    def gen(c: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        gens = captured_generate(llm, prompts[:c], sp)
        dt = (time.perf_counter() - t0, time.process_time() - c0)
        if any(len(g.response) != a.response_len for g in gens):
            raise RuntimeError("a request did not generate exactly --response-len tokens")
        return dt

    gen(max(conc))                                               # warm-up
    times = {c: [] for c in conc}
    for _ in range(a.repeats):                                   # interleaved: same machine state for all
        for c in conc:
            times[c].append(gen(c))
    print("RESULT " + json.dumps({"wall_s": {str(c): statistics.median(t[0] for t in v) for c, v in times.items()},
                                  "cpu_s": {str(c): statistics.median(t[1] for t in v) for c, v in times.items()}}),
          flush=True)


if __name__ == "__main__":
    main()
