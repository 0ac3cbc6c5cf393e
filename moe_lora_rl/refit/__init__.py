"""LoRA-only refit from Megatron to rollout engines: a pure plan, a gather, and one mover class per transport.

    gather TP/ETP -> collect EP/PP -> rename to PEFT -> bucket -> send (versioned, checksummed) -> engine commits
"""
