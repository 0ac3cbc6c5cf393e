"""The test kit: oracles, check drivers and workers only tests use, outside the installed package. Imported as `kit`
(tests/conftest.py puts tests/ first on sys.path and on PYTHONPATH, so a worker a test starts imports it too:
`python -m kit.X`, run_torchrun("kit.X", ...)); scripts/gpu_check.sh does the same for the GPU check. What tests
and benches share is moe_lora_rl/checks; the benches' processes are moe_lora_rl/bench/workers.

    fakes.py                    FakeEngine: the push protocol and request versions without vLLM
    gpu_check.py + gpu_check_worker.py + policy_update_worker.py
                                scripts/gpu_check.sh (CUDA bf16 vs the CPU, CUDA IPC); the policy-update worker is
                                tests/distributed/test_policy_update.py's too
    checkpoint_crash.py, checkpoint_worker.py, bank_setup.py, minibatch_worker.py, rank0_wait_worker.py,
    recompute_worker.py, refit_stream_worker.py, moe_options.py + moe_options_worker.py, kv_replay_worker.py,
    hybrid_parity.py            the distributed tests' drivers and torchrun workers
    refit_vllm.py, base_sync.py, mla_serve.py, inflight.py, served_megatron.py, version_reuse.py, weight_faults.py
    (+ weight_fault_cells), sparse_evict.py, sparse_sampler.py, sparse_probe.py, serve_capture.py (+ vllm_peft)
                                engine checks and their references (tests/e2e)
    import_inert.py             a fresh interpreter's check that importing the package patches nothing
    slurm_cluster.py            the local two-node slurm of tests/cluster
    train_faults.py             the main job's engine or trainer rank killed once a step is logged
"""
