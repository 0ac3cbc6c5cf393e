"""Benches refuse what they cannot do before any process starts: one line naming the value, exit code 2, no
traceback. A part a bench cannot measure on a model is named with the reason in its JSON line. Batches are sized from
every layout's data-parallel size."""
import subprocess
import sys

import pytest

from moe_lora_rl.checks.layouts import dp_batch
from moe_lora_rl.megatron.layout import Layout


@pytest.mark.parametrize("argv,needle", [
    (["lora", "--no-speed", "--layouts", "ep6"], "ep=6 does not divide num_experts="),
    (["replay", "--engine", "hf", "--layouts", "tp1ep1pp1,tp2ep3"], "ep=3 does not divide num_experts="),
    (["parity", "--layouts", "tp2,xx3"], "layout 'xx3' is not a combination"),
    (["refit", "--layouts", "tp1ep1pp1,ep5"], "ep=5 does not divide num_experts="),
    (["replay", "--engine", "hf", "--model", "/nonexistent"], "--model '/nonexistent': not an HF checkpoint"),
    (["replay", "--engine", "hf", "--dtype", "fp16"], "dtype='fp16': choose one of"),
    (["e2e", "--layouts", "tp2ep2,pp2"], "e2e runs one layout"),
    (["e2e", "--layouts", "tp2ep2", "--nproc", "1"], "world size"),
    (["e2e", "--", "algo.lr=-1"], "algo.lr=-1"),
    (["e2e", "--", "lora.rnk=4"], "unknown config key"),
    (["e2e", "--data", "nope"], "dataset 'nope' is not one of"),
    (["async", "--layouts", "tp2ep2,pp2"], "async runs one layout"),
    (["async", "--seeds", "0,x"], "--seeds='0,x'"),
    (["async", "--max-staleness", "0"], "--max-staleness=0"),
    (["async", "--sync-nproc", "2,1", "--layouts", "tp2ep2"], "world size"),
    (["async", "--inflight", "pin", "--max-staleness", "4"], "rollout.max_versions=4"),

    (["r3_ab", "--setting", "huge"], "--setting='huge' is not one of"),
    (["long", "--", "algo.max_response_tokens=100"], "algo.max_response_tokens=100 is below the longest answer"),
    (["long", "--", "algo.mini_batches=3"], "algo.mini_batches=3"),

    (["verl", "--layouts", "tp2ep3"], "ep=3 does not divide num_experts="),
    (["verl", "--layouts", "pp2ep4"], "--layouts 'pp2ep4': runs on 8 ranks; this bench launches 4"),
    (["verl", "--reuse"], "--reuse reads the runs of --out: give --out DIR"),
    (["verl", "--learn-steps", "0"], "--learn-steps 0 / --test-freq 10 / --async-steps 4: each must be >= 1"),
    (["verl", "--no-runs", "--png", "x.png"], "--no-runs runs no main_ppo"),
    (["verl", "--main-job", "/nonexistent"], "--main-job '/nonexistent': no metrics.jsonl there"),
    (["verl_user", "--steps", "7", "--test-freq", "2"], "--steps 7 / --test-freq 2: both >= 1, steps a multiple"),
    (["verl_user", "--lr", "0"], "--lr 0.0: must be > 0 (the control runs at 0)"),
    (["verl_user", "--reuse"], "--reuse reads the runs of --out: give --out DIR"),
    (["verl_user", "--no-learn", "--png", "x.png"], "--png plots the learning run: leave out --no-learn"),
    (["sync", "--bucket-mb", "0"], "--bucket-mb 0.0: must be > 0"),
    (["sync", "--model", "/nonexistent"], "/nonexistent: no *.safetensors files to send"),
])
def test_user_errors_are_one_line(argv, needle, capsys):
    """In process, through the bench CLI's own main (what `python -m moe_lora_rl.bench` runs): exit code 2 and one
    line naming the value; the process itself is checked once below."""
    from moe_lora_rl.bench.__main__ import main

    try:
        rc = main(argv)
    except SystemExit as e:                          # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err[-2000:]


def test_user_error_of_the_process_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "moe_lora_rl.bench", "e2e", "--", "algo.lr=-1"], capture_output=True,
                          text=True, timeout=300)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "algo.lr=-1" in lines[0], proc.stderr[-2000:]


def test_batch_splits_over_every_data_parallel_size():
    assert dp_batch([Layout.parse(n) for n in ("tp1ep1pp1", "tp2ep2", "ep4", "pp2ep2")], 4) == 4
    assert dp_batch([Layout.parse("ep6")], 4) == 6                     # world 6, data parallel 6
    assert dp_batch([Layout.parse("tp2ep3")], 4) == 6                  # world 6, data parallel 3
    assert dp_batch([Layout.parse("ep4"), Layout.parse("ep3")], 8) == 12


def test_a_part_bench_serve_cannot_measure_is_named_with_the_reason():
    from moe_lora_rl.bench.workers.serve_numerics import cpu_kernel_missing
    from moe_lora_rl.bench.workers.serve_worker import MAX_EXACT_VOCAB, exact_kl_skipped

    assert exact_kl_skipped(512) == {} and exact_kl_skipped(MAX_EXACT_VOCAB) == {}
    assert exact_kl_skipped(151936) == {"kl_exact": "vocabulary 151936 > 8192: the exact KLs need the full "
                                                    "distribution at every position (max_logprobs = vocabulary)"}
    why = cpu_kernel_missing()                                   # None where vLLM's CPU build is installed
    assert why is None or why.startswith("vLLM's CPU fused-MoE kernel is not in this vLLM build"), why
