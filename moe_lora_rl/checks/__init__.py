"""The measuring kit tests and benches share (product code never imports it; it imports the product, never bench/):
the torchrun launcher and worker preamble, every tolerance, the layouts, the reference oracles, and the checks a test
and a bench both run, with their workers (many checks per torchrun launch: imports cost 5-13 s per rank).
Test-only oracles and workers live in tests/kit; the benches' own processes in bench/workers; the peers' runners in
bench/runners.

    tolerances.py     every tolerance and target, each with its justification
    launch.py         run_torchrun / run_process (parent); worker_args, each_model_at_layout, finish_worker (worker)
    jobs_worker.py    run_torchrun_jobs' process: several workers' mains in one launch (the ranks meet once)
    layouts.py        models (--model or the tiny ones) and layouts checked up front, grouped by world size
    train_runs.py     the main job launched under torchrun, its outputs read back
    hf.py, route_reference.py, forced_routes.py, hf_routes.py, dispatch_capture.py, data.py, logprobs.py
                      oracles and inputs
    adapters.py, peft_native.py
                      adapters set to seeded nonzero values (layout independent); PEFT's own adapters on HF
    parity.py, lora_layouts.py + lora_worker.py, replay.py + replay_worker.py + rollout_vllm_worker.py
                      checks run by tests and by bench parity / lora / refit / replay
    verl_worker.py (+ verl_data, verl_adapter_path, verl_stream), verl_refit.py, verl_async.py, verl_compose.py
                      the verl harness: tests/*/test_verl_* and bench verl
    mla_bf16.py       python -m moe_lora_rl.checks.mla_bf16: where a bf16 engine's KL to fp32 comes from (docs/mla.md)
"""
