"""What tests and benches share: the torchrun launcher and worker preamble, the reference oracles, the fakes, the
check drivers and their workers (many checks per torchrun launch: imports cost 5-13 s per rank), and every
tolerance. Product code never imports this package; it imports the product, never bench/.

    tolerances.py     every tolerance and target, each with its justification
    launch.py         run_torchrun / run_process (parent); worker_args, each_model_at_layout, finish_worker (worker)
    layouts.py        models (--model or the tiny ones) and layouts checked up front, grouped by world size
    hf.py, route_reference.py, forced_routes.py, hf_routes.py, dispatch_capture.py, data.py, logprobs.py
                      oracles and inputs
    adapters.py       adapters set to seeded nonzero values (layout independent)
    fakes.py          FakeEngine: the push protocol and request versions without vLLM (the plugin's Staging,
                      VersionTable and adapter check)
    parity.py, lora_layouts.py + lora_worker.py, replay.py + replay_worker.py, refit_stream_worker.py,
    refit_vllm.py, vllm_peft.py, serve_capture.py, serve_numerics.py, checkpoint_worker.py,
    policy_update_worker.py, verl_*.py
                      check drivers and workers
    lora_steps_worker.py, plan_rollout_worker.py + plan_train_worker.py, refit_vllm_worker.py,
    rollout_vllm_worker.py, serve_worker.py + serve_inflight.py, sparse_kv_worker.py, verl_runs.py
                      the processes the benches launch (bench/ keeps the arguments, the timing and the JSON line)
    gpu_check.py + gpu_check_worker.py
                      scripts/gpu_check.sh: R3 + a LoRA step on CUDA bf16 against the CPU, and a CUDA IPC handoff
"""
