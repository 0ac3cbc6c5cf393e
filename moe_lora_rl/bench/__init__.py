"""python -m moe_lora_rl.bench NAME --json: one module per bench (__main__.BENCHES: its arguments, its timing, its one
JSON line), with what the benches share (common.py, run_args.py, figures.py, kept_runs.py). The processes they start
are in workers/, the peers' runners of bench peers in runners/; the checks and oracles they share with the tests in
moe_lora_rl/checks. Product code never imports this package."""
