"""What the bench entries run and read back (bench/ keeps the arguments, the timing and the JSON line): the main job,
the peers' runs scored by one evaluator, verl's runs, each bench's runs with their pure settings and summaries, the
planner's model fitted to them, and the figures drawn from them.

    jobs.py          the main job as the whole-job benches run it (e2e, long, async, r3_ab, sparse, policies)
    kept_runs.py     runs kept in --out, one folder each: read back, resumed or refused (r3_ab, sparse)
    r3_ab_runs.py, sparse_runs.py     those benches' settings, overrides and summaries (pure); sparse's KV runs
    plan_model.py    the planner's step and answer-length models against measured runs (plan, async; pure)
    plan_runs.py     bench plan's calibration runs (the matmul ceiling, the rollout and training workers)
    refit_transports.py, sync_peer.py    bench refit's cross-process pushes, bench sync's two-engine runs
    hf_grpo.py       bench grpo_hf's reference run: GRPO with LoRA in HF transformers + peft, one process
    peer_runs.py     run_ours / run_trl / run_verl / run_peers: each run read back (reward curve, PEFT adapter, time)
    peer_task.py     the task every peer trains and the evaluator scores (pure)
    peer_eval.py     the one evaluator: HF transformers + peft, fp32, on the held-out problems
    trl_env.py       TRL's own environment (.venv-trl); trl_grpo.py: TRL's GRPOTrainer run in it
    verl_runs.py     verl's main_ppo and async trainers through our recipe, and what is read from their logs
    verl_user_runs.py    the verl user's LoRA script: learning, resumes at other layouts, one-step-off (verl_user)
    peak_rss.py      peak resident memory of everything a run starts
    figures.py       the curve panels: one style, one way to save, each bench's figure
"""
