"""The rollout engine (rollout/client.py + rollout/server.py) on the tiny glm4_moe model, fp32, prefix caching and
routing capture on, one engine process (plus one restart):

- the logprobs of sampled tokens equal HF transformers' log_softmax(logits / T) of the same sequences within 1e-3
  (fp32 engine vs fp32 HF: the serve bench measures ~1e-4), before and after an expert adapter is pushed through
  engine.transport (ShmTransport), the latter against HF with the adapter merged; negative controls: the reference
  at another temperature, the base model after the push, and a perturbed adapter (lora_B * 1.1) are all > 1e-2 off;
- routes are complete for groups of 4 samples per prompt with prefix caching on (the prompts span a full KV block,
  so 3 of 4 samples take the prompt's routes from the prefix store) and agree with HF routing on >= 99% of
  (token, layer) decisions;
- same seeds, same tokens (also after a restart); other seeds give other tokens;
- greedy (temperature 0) picks HF's argmax;
- a killed engine is EngineDied naming the signal on the next call; restart() serves again;
- bad input is a ValueError naming the value, raised before any request (shown on an engine never started);
- the routing capture cannot be stopped over /collective_rpc (allow-list); a request whose routes cannot be popped
  fails alone (RuntimeError), never a sample without routes: tests/unit/test_engine_loop.py.
"""
import os
import signal

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

TOL = 1e-3
CONTROL = 1e-2
T = 0.7
GROUP = 4
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    from moe_lora_rl.rollout.client import RolloutEngine

    eng = RolloutEngine.start(model, dtype="float32", log_dir=tmp_path_factory.mktemp("rollout"))
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def prompts(arch):
    g = torch.Generator().manual_seed(3)
    return [p for p in torch.randint(3, arch.vocab_size, (2, 40), generator=g).tolist() for _ in range(GROUP)]


SEEDS = list(range(100, 100 + 2 * GROUP))


@pytest.fixture(scope="module")
def base_run(engine, prompts):
    return engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)


def hf_logprobs(hf, samples, temperature) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor([s.prompt + s.response])
            lp = torch.log_softmax(hf(input_ids=seq).logits[0].double() / temperature, -1)
            p = len(s.prompt)
            out.append(lp[p - 1:p - 1 + len(s.response)].gather(-1, torch.tensor(s.response)[:, None])[:, 0])
    return out


def max_diff(samples, ref) -> float:
    return max((torch.tensor(s.logprobs, dtype=torch.float64) - r).abs().max().item() for s, r in zip(samples, ref))


def check_routes(samples, hf, arch) -> float:
    from moe_lora_rl.checks.route_reference import agreement, hf_routes

    moe = [l for l, m in enumerate(arch.moe_layers) if m]
    for s in samples:
        assert s.routes is not None
        assert s.routes.shape == (len(s.prompt) + len(s.response) - 1, len(moe), arch.topk), s.routes.shape
    return agreement([s.routes for s in samples], hf_routes(hf, moe, [(s.prompt + s.response)[:-1] for s in samples]))


def test_bad_input_is_refused_before_sending(model, tmp_path):
    from moe_lora_rl.rollout.client import EngineDied, RolloutEngine

    never_started = RolloutEngine(model, log_dir=tmp_path)         # any request would raise EngineDied
    ok = dict(seeds=[1], max_tokens=4, temperature=1.0)
    for prompts, kw, needle in [([[]], ok, "prompts[0]"), ([], ok, "prompts"),
                                ([[1, 2]], {**ok, "seeds": [1, 2]}, "seeds"),
                                ([[1, 2]], {**ok, "max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
                                ([[1, 2]], {**ok, "temperature": -1.0}, "temperature"),
                                ([[1, -2]], ok, "prompts[0]")]:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            never_started.generate(prompts, **kw)
    with pytest.raises(EngineDied, match="stopped"):                 # control: a valid call does reach the process
        never_started.generate([[1, 2]], **ok)
    with pytest.raises(ValueError, match="dtype"):
        RolloutEngine(model, dtype="fp8")


def test_server_refuses_what_only_it_can_check(engine, arch):
    with pytest.raises(ValueError, match="vocabulary size"):
        engine.generate([[1, arch.vocab_size]], seeds=None, max_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1, 2]], seeds=None, max_tokens=600, temperature=1.0)


def test_base_logprobs_and_routes_match_hf(engine, base_run, model, arch):
    from moe_lora_rl.checks.route_reference import merged_hf_model

    hf = merged_hf_model(model, None, 1.0, torch.float32)
    assert len(base_run) == 2 * GROUP and all(len(s.response) == len(s.logprobs) > 0 for s in base_run)
    assert all(s.finish_reason in ("length", "stop") for s in base_run)
    d = max_diff(base_run, hf_logprobs(hf, base_run, T))
    assert d < TOL, d
    assert max_diff(base_run, hf_logprobs(hf, base_run, 1.0)) > CONTROL     # the temperature is applied
    assert check_routes(base_run, hf, arch) >= 0.99
    assert engine.status()["capture"]["prefix_route_hits"] > 0              # the group shared the prompt's blocks


def test_same_seeds_same_tokens(engine, prompts, base_run):
    again = engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)
    assert [s.response for s in again] == [s.response for s in base_run]
    assert [s.logprobs for s in again] == [s.logprobs for s in base_run]
    other = engine.generate(prompts, seeds=[s + 1000 for s in SEEDS], max_tokens=12, temperature=T)
    assert [s.response for s in other] != [s.response for s in base_run]


def test_greedy_is_hf_argmax(engine, prompts, model):
    from moe_lora_rl.checks.route_reference import merged_hf_model

    hf = merged_hf_model(model, None, 1.0, torch.float32)
    out = engine.generate(prompts[::GROUP], seeds=None, max_tokens=8, temperature=0)
    with torch.no_grad():
        for s in out:
            logits = hf(input_ids=torch.tensor([s.prompt + s.response])).logits[0]
            p = len(s.prompt)
            assert s.response == logits[p - 1:p - 1 + len(s.response)].argmax(-1).tolist()
    assert max_diff(out, hf_logprobs(hf, out, 1.0)) < TOL


def test_capture_cannot_be_stopped_from_outside(engine, prompts, base_run):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{engine.transport.base_url}/collective_rpc", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {engine.token}"},
        data=json.dumps({"method": "moe_lora_capture_stop"}).encode())
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and b"is not callable over /collective_rpc" in e.value.read()
    again = engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)
    assert [s.response for s in again] == [s.response for s in base_run]
    assert all(s.routes.shape[0] == len(s.prompt) + len(s.response) - 1 for s in again)


def test_pushed_adapter_matches_merged_hf(engine, prompts, model, arch):
    from moe_lora_rl.checks.route_reference import merged_hf_model, random_expert_adapter

    peft = random_expert_adapter(arch, RANK, seed=7)
    push_before = engine.push_s
    res = engine.transport.push(1, peft, RANK, ALPHA)
    assert res.served["version"] == 1 and engine.status()["version"] == 1
    assert engine.push_s > push_before
    with pytest.raises(ValueError, match="stale adapter version 1"):      # refused by the engine, over HTTP
        engine.transport.push(1, peft, RANK, ALPHA)
    assert engine.status()["version"] == 1
    out = engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)
    hf = merged_hf_model(model, peft, ALPHA / RANK, torch.float32)
    d = max_diff(out, hf_logprobs(hf, out, T))
    assert d < TOL, d
    assert check_routes(out, hf, arch) >= 0.99
    perturbed = {k: v * 1.1 if ".lora_B." in k else v for k, v in peft.items()}
    assert max_diff(out, hf_logprobs(merged_hf_model(model, perturbed, ALPHA / RANK, torch.float32), out, T)) \
        > CONTROL
    assert max_diff(out, hf_logprobs(merged_hf_model(model, None, 1.0, torch.float32), out, T)) > CONTROL


def test_killed_engine_is_reported_and_restart_serves_again(engine, prompts, base_run):
    from moe_lora_rl.rollout.client import EngineDied

    pid = engine.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDied, match=rf"pid {pid}\) exited with code -9 \(SIGKILL\)"):
        engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)
    with pytest.raises(EngineDied):
        engine.transport.push(2, {"x": torch.zeros(4)}, RANK, ALPHA)
    assert not engine.alive()
    engine.restart()
    assert engine.alive() and engine.pid != pid
    assert engine.status()["version"] is None                      # a fresh process serves the base model
    again = engine.generate(prompts, seeds=SEEDS, max_tokens=12, temperature=T)
    assert [s.response for s in again] == [s.response for s in base_run]
    assert np.allclose([x for s in again for x in s.logprobs], [x for s in base_run for x in s.logprobs], atol=0)

