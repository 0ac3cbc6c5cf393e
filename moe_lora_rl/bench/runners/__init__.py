"""The peers' runners of bench peers (and the verl runs of bench verl): each peer trained on one task and read back
the same way, scored by one evaluator.

    peer_runs.py     run_ours / run_trl / run_verl / run_peers: each run read back (reward curve, PEFT adapter, time)
    peer_task.py     the task every peer trains and the evaluator scores (pure)
    peer_eval.py     the one evaluator: HF transformers + peft, fp32, on the held-out problems
    trl_env.py       TRL's own environment (.venv-trl); trl_grpo.py: TRL's GRPOTrainer run in it
    verl_runs.py     verl's main_ppo through our recipe, and what is read from its log
    peak_rss.py      peak resident memory of everything a run starts
"""
