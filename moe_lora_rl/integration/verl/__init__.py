"""veRL integration: the only package that imports verl.

Our engine, rollout replica and CPU platform are registered with verl's registries (plugin.register) when verl
imports this package as `actor_rollout_ref.model.external_lib=moe_lora_rl.integration.verl` (verl is loaded by
then), and when verl resolves our engine config (`actor.megatron._target_`, module config.py). Imported without
verl loaded (e.g. for `algos`), it registers nothing and does not import verl.
"""
import sys

if "verl" in sys.modules:
    from .plugin import register

    register()
