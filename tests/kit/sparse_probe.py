"""Where a compressed-KV sampler loses answers: the long task's held-out prompts sampled by one engine (dense or
compressed), each scored, by list size; with snapkv, how much of the prompt each sample still held at its last
compression (from the engine's own record of the kept positions, vllm/kv_evict.py).

    python -m kit.sparse_probe --model DIR --method none|window|snapkv [--budget N] [--evict JSON]
        [--task sort_long|sort_trace] [--n-eval 128] [--samples 1] [--max-tokens 400] [--sizes 8,11,14,18,22]
        ->  "RESULT {...}"

by_size: per list-size bucket (lower edges from --sizes): samples, success, answer tokens (mean), and for snapkv the
fraction of the prompt held at the end, over the bucket's successes and failures apart (prompt_held_ok,
prompt_held_fail). Run it once per method on the same model and seeds: the buckets line up.
"""
from __future__ import annotations

import json


def prompt_held(record: dict, prompt_len: int, total: int) -> float | None:
    """Fraction of the prompt's positions that every layer and KV head held at the end of a sample (mean over layers
    and heads): the last compression's kept positions, and those in its recent window. None: never compressed."""
    events = record["events"]
    if not events:
        return None
    s, kept = events[-1]
    recent = set(range(max(0, s - record["recent"]), min(s, total)))
    fracs = [len({p for p in head if p < prompt_len} | {p for p in recent if p < prompt_len}) / prompt_len
             for layer in kept for head in layer]
    return sum(fracs) / len(fracs)


def bucket_summary(rows: list[dict], edges: list[int]) -> list[dict]:
    """rows: {"size", "ok", "tokens", "held"} per sample -> one summary per size bucket [edge_i, edge_i+1)."""
    out = []
    for lo, hi in zip(edges, [*edges[1:], None]):
        rs = [r for r in rows if r["size"] >= lo and (hi is None or r["size"] < hi)]
        if not rs:
            continue

        def held(ok):
            vals = [r["held"] for r in rs if r["ok"] == ok and r["held"] is not None]
            return sum(vals) / len(vals) if vals else None

        out.append({"sizes": f"{lo}-{hi - 1}" if hi else f"{lo}+", "samples": len(rs),
                    "success": sum(r["ok"] for r in rs) / len(rs), "tokens": sum(r["tokens"] for r in rs) / len(rs),
                    "prompt_held_ok": held(True), "prompt_held_fail": held(False)})
    return out


def main(argv=None) -> dict:
    from moe_lora_rl.rollout.vllm_engine import make_engine, set_engine_env
    from moe_lora_rl.bench.workers.sparse_kv_worker import engine_parser

    set_engine_env()
    ap = engine_parser()
    ap.add_argument("--task", default="sort_long")
    ap.add_argument("--n-eval", type=int, default=128)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--sizes", default="8,11,14,18,22", help="lower edges of the list-size buckets")
    a = ap.parse_args(argv)
    edges = [int(x) for x in a.sizes.split(",")]
    if a.samples < 1 or a.n_eval < 1 or a.max_tokens < 1 or edges != sorted(set(edges)):
        raise SystemExit(f"sparse_probe: --samples={a.samples}, --n-eval={a.n_eval}, --max-tokens={a.max_tokens} "
                         f"must be >= 1 and --sizes={a.sizes!r} increasing")
    import transformers
    from vllm import SamplingParams

    from moe_lora_rl.data.hf_sampling import prompt_ids, score
    from moe_lora_rl.data.task import TaskSpec, make_split
    from moe_lora_rl.rollout.kv_compression import engine_kwargs, install_method, verify

    cfg = json.loads(open(f"{a.model}/config.json").read())
    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    problems = make_split(TaskSpec(kind=a.task, n_eval=a.n_eval), "eval")
    prompts = prompt_ids(tok, problems)
    max_len = -(-(max(map(len, prompts)) + a.max_tokens) // 32) * 32
    llm = make_engine(a.model, prefix_caching=False, block_size=32, max_model_len=max_len, max_num_seqs=64,
                      **engine_kwargs(a.method, a.budget, cfg))
    layout = verify(llm, a.method, a.budget)
    evictor = install_method(llm, a.method, a.budget, a.evict, keep_events=True)
    eng, rows = llm.llm_engine, []
    for s in range(a.samples):
        for i, p in enumerate(prompts):
            eng.add_request(f"{s}-{i}", {"prompt_token_ids": p},
                            SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=s * 100003 + i,
                                           detokenize=False))
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        for i, p in enumerate(problems):
            resp = list(done[f"{s}-{i}"].outputs[0].token_ids)
            record = evictor.pop_events(f"{s}-{i}") if evictor else None
            rows.append({"size": len(p.digits), "ok": score(tok, [p], [resp])[0] > 0.5, "tokens": len(resp),
                         "held": prompt_held(record, len(prompts[i]), len(prompts[i]) + len(resp)) if record else None})
    res = {"method": a.method, "budget": a.budget, "evict": a.evict, "task": a.task, "layout": layout,
           "samples": len(rows), "success": sum(r["ok"] for r in rows) / len(rows),
           "by_size": bucket_summary(rows, edges), "evictions": evictor.stats() if evictor else None}
    print("RESULT " + json.dumps(res))
    return res


if __name__ == "__main__":
    main()
