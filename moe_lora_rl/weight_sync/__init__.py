"""Full-weight sync: the base model from the trainer (or a live engine) to rollout engines that start empty.
calc.py predicts its time at scale; the adapters' per-step refit stays in refit/."""
