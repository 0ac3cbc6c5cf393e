"""python -m moe_lora_rl.bench NAME --json: one entry module per bench (__main__.BENCHES: its arguments, its timing,
its one JSON line; common.py emits it, run_args.py reads --device/--dtype). What an entry runs and reads back is in
runners/ (the main job, the peers', verl's, each bench's runs, their models and figures); the processes it starts are
workers/; the checks and oracles it shares with the tests are moe_lora_rl/checks. Product code never imports this
package."""
