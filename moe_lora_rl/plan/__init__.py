"""Layout planner for MoE LoRA RL: which training and rollout layouts fit, how to split the GPUs so rollout
production matches training consumption under a staleness bound, and the steps/min that gives.
`moe-lora-rl plan` / `python -m moe_lora_rl.plan`; formulas in formulas.py, search in search.py, and the size
calculators the planner and the benches share: refit_calc.py (adapter bytes and the refit's time) and sync_calc.py
(the full-weight sync's time; `plan --sync`, sync_plan.py)."""
from .search import Plan, plan
from .specs import PRESETS, Hardware, ModelSpec, RLSettings, load_hardware, load_model

__all__ = ["Plan", "plan", "PRESETS", "Hardware", "ModelSpec", "RLSettings", "load_hardware", "load_model"]
