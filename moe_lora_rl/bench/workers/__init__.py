"""The processes the benches start, and the in-process pieces only they use (bench/ keeps the arguments, the timing
and the JSON line; the shared kit is checks/). Tests launch some of them too, as the bench does.

    lora_steps_worker.py                      torchrun: full fine-tuning vs LoRA steps (bench lora, bench recompute)
    plan_rollout_worker.py, plan_train_worker.py   the planner's calibration runs (bench plan)
    refit_vllm_worker.py                      LoRA-only push vs full reload on one vLLM engine (bench refit)
    serve_worker.py (+ serve_inflight, serve_numerics, serve_engine)
                                              both serving modes: speed, numerics, pushes in flight (bench serve)
    sparse_kv_worker.py                       the KV worker: dense vs compressed at a fixed pool (bench sparse)
"""
