"""veRL integration: the only package that imports verl (besides `moe_lora_rl.algos`, verl's pure functions).

Importing this package registers nothing and imports no verl. verl loads `plugin.py`, the one composition root, by
the names our recipe sets (`model.external_lib`, the engine config's `_target_`, the checkpoint engine's
`custom_backend_module`, and `VERL_USE_EXTERNAL_MODULES` for Ray workers on the CPU platform); importing it registers
our engine, replica, checkpoint-engine backend and CPU platform with verl's registries.
"""
