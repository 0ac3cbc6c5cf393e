"""bench peers: its refusals (one line, before anything runs), a failing peer reported alone while the others
report, TRL's environment refused with one line when it cannot be set up, and the one evaluator: a fresh adapter
scores exactly what the base scores, a perturbed one far lower (the control)."""
import re
import subprocess
import sys

import pytest

from moe_lora_rl.bench.runners.peer_runs import PeerFailed, run_peers
from moe_lora_rl.bench.runners import trl_env


@pytest.mark.parametrize("args, needle", [
    (["--peers", "ours,trlx"], "unknown peer trlx"),
    (["--peers", "trl"], "needs ours"),
    (["--steps", "0"], "--steps=0"),
    (["--eval-samples", "0"], "--eval-samples=0"),
    (["--rollout-dtype", "fp16"], "--rollout-dtype='fp16'"),
    (["--eval-every", "0"], "--eval-every=0"),
    (["--steps", "10", "--eval-every", "20"], "--eval-every=20 is more than --steps=10"),
    (["--target", "1.5"], "--target=1.5"),
    (["--reuse"], "--reuse reads the runs of --out"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--serving", "fused"], "--serving='fused': choose unmerged or merged"),
    (["--task", "sort_long"], "--task='sort_long': choose one of ['sort', 'sort_trace']"),
    (["--task", "sort_trace"], "--task=sort_trace with verl: its recipe"),
    (["--task", "sort_trace", "--peers", "ours,ours_async,verl"], "leave verl out of --peers")])
def test_refusals_before_anything_runs(args, needle, monkeypatch):
    from moe_lora_rl.bench import peers
    from moe_lora_rl.bench.runners import peer_runs

    def never(*a, **k):
        raise AssertionError("a peer ran")

    monkeypatch.setattr(peer_runs, "run_peers", never)
    with pytest.raises(ValueError, match=re.escape(needle)):
        peers.main(args)


def test_a_refusal_is_one_line_of_the_cli():
    p = subprocess.run([sys.executable, "-m", "moe_lora_rl.bench", "peers", "--peers", "ours,trlx"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == "bench peers: error: --peers 'ours,trlx': unknown peer trlx; choose from ours, " \
                               "ours_async, trl, verl", p.stderr


def test_a_failing_peer_stops_alone():
    calls = []

    def ok(name):
        calls.append(name)
        return {"samples": 64}

    def broken():
        calls.append("trl")
        raise PeerFailed("trl: its run failed (rc 1): boom")

    results, errors = run_peers(["ours", "trl", "verl"], {"ours": lambda: ok("ours"), "trl": broken,
                                                          "verl": lambda: ok("verl")})
    assert calls == ["ours", "trl", "verl"] and set(results) == {"ours", "verl"}
    assert errors == {"trl": "trl: its run failed (rc 1): boom"}
    with pytest.raises(ZeroDivisionError):              # anything but a peer's failure is a defect: not swallowed
        run_peers(["ours"], {"ours": lambda: 1 / 0})


def test_trl_environment_that_cannot_be_set_up_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(trl_env, "TRL_VERSION", "0.0.0-none")          # no such release: pip fails
    with pytest.raises(trl_env.PeerUnavailable, match=r"^trl: could not set up .*venv-trl") as e:
        trl_env.ensure(tmp_path / ".venv-trl")
    assert "\n" not in str(e.value)


def test_one_evaluator_zero_adapter_equals_base_and_a_perturbed_one_fails(tmp_path):
    """A fresh PEFT adapter (B = 0) scores exactly the base (same problems, samples, seeds); the same adapter with
    B perturbed scores far lower (control: the evaluator reads the adapter)."""
    import peft
    import torch
    import transformers

    from moe_lora_rl.bench.runners.peer_eval import evaluate
    from moe_lora_rl.rl.config import TrainConfig
    from moe_lora_rl.rl.inputs import model_dir

    base = str(model_dir(TrainConfig())[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(str(tmp_path / "zero"))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 4.0)
    lora.save_pretrained(str(tmp_path / "perturbed"))
    kw = dict(n_eval=64, samples=1, seed=0)     # one sample a problem: half the generation of two, the same checks
    ref = evaluate(base, None, **kw)            # (measured: base 0.219, the zero adapter equal, perturbed 0.0)
    assert ref["n"] == 64 and 0.1 < ref["success"] < 0.6
    assert evaluate(base, tmp_path / "zero", **kw) == ref
    assert evaluate(base, tmp_path / "perturbed", **kw)["success"] < ref["success"] - 0.1


def test_the_long_task_is_the_same_for_every_peer_and_the_evaluator():
    """sort_trace: our main job's overrides load into that task; TRL's training lists (the task's split) exclude the
    evaluator's held-out lists, which are a prefix of the task's held-out set whatever --n-eval."""
    from moe_lora_rl.bench.runners.peer_task import peer_task
    from moe_lora_rl.rl import config
    from moe_lora_rl.data.task import make_split

    spec, max_tokens, over = peer_task("sort_trace")
    cfg = config.load(over)
    assert cfg.data.task_spec() == spec and cfg.algo.max_response_tokens == max_tokens == 96
    held = make_split(peer_task("sort_trace", 64)[0], "eval")
    assert [p.digits for p in held] == [p.digits for p in make_split(spec, "eval")[:64]]
    assert len(held[0].answer.split()) > 40 and held[0].kind == "sort_trace"        # a written trace, not the sort
    taken = {tuple(sorted(p.digits)) for p in make_split(spec, "eval")}
    assert not taken & {tuple(sorted(p.digits)) for p in make_split(spec, "train")[:2000]}
    assert peer_task("sort") == (config.load([]).data.task_spec(), 8, [])
