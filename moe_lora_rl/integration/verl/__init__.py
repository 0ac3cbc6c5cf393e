"""veRL integration: the only package that imports verl (besides `moe_lora_rl.algos`, verl's pure functions).

Importing this package registers nothing and imports no verl, unless the process asked verl to load our plugin
(VERL_USE_EXTERNAL_MODULES names it): then verl is imported here first, so that verl's own import of `plugin.py` never
finds one of this package's modules half-imported (a module of ours imported before verl would otherwise import
verl, which imports the plugin, which imports that module again). verl loads `plugin.py`, the one composition root,
by the names our recipe sets (`model.external_lib`, the engine config's `_target_`, the checkpoint engine's
`custom_backend_module`, and `VERL_USE_EXTERNAL_MODULES` for Ray workers on the CPU platform); importing it registers
our engine, replica, checkpoint-engine backend and CPU platform with verl's registries.
"""
import os as _os

if "moe_lora_rl.integration.verl.plugin" in _os.environ.get("VERL_USE_EXTERNAL_MODULES", "").replace(" ", "").split(","):
    import verl  # noqa: F401  (verl imports plugin.py before any other module of this package runs)
