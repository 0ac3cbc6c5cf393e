"""rl/producer.py's evaluate_together: several policies' held-out evaluations in one engine call per engine give each
policy what its own evaluation gives (same problems, seeds and versions); control: the versions swapped between the
policies give other rates. The engines are stand-ins whose answer depends on (prompt, seed, version)."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from moe_lora_rl.rl.producer import Producer, evaluate_together


class Engine:
    def __init__(self):
        self.calls = 0

    def generate(self, prompts, seeds, versions=None, **sampling):
        self.calls += 1
        versions = versions or [None] * len(prompts)
        out = []
        for p, s, v in zip(prompts, seeds, versions):
            h = hashlib.sha256(repr((p, s, v)).encode()).digest()
            out.append(SimpleNamespace(response=list(h[: 1 + h[0] % 5])))
        return out


class Engines(list):
    def map(self, fn, which, keep):
        for i in which:
            keep.setdefault(i, fn(i, self[i]))
        return keep


def producer(seed: int, problems: int, engines) -> Producer:
    p = Producer.__new__(Producer)
    p.cfg = SimpleNamespace(seed=seed, data=SimpleNamespace(eval_samples=3),
                            algo=SimpleNamespace(max_response_tokens=8, temperature=1.0))
    p.tok = SimpleNamespace(eos_token_id=0)
    p.eval_problems = [100 * seed + q for q in range(problems)]
    p._eval_prompts = [[7, q] for q in p.eval_problems]
    p.rewards = lambda samples, probs: [float((s.response[0] + q) % 3 == 0) for s, q in zip(samples, probs)]
    p.kv_snapshot = lambda: []
    p.engines = engines
    return p


@pytest.mark.parametrize("n_engines", [1, 2])
def test_joint_evaluation_equals_each_alone(n_engines):
    engines = Engines(Engine() for _ in range(n_engines))
    a, b = producer(1, 11, engines), producer(2, 6, engines)
    alone = [a.evaluate(3), b.evaluate(5)]
    lens = [sorted(a.eval_lens), sorted(b.eval_lens)]
    calls = sum(e.calls for e in engines)
    joint = evaluate_together([a, b], [3, 5], engines)
    assert joint == alone and 0 < min(joint) and max(joint) < 1, (joint, alone)
    assert [sorted(a.eval_lens), sorted(b.eval_lens)] == lens
    assert len(a.eval_lens) == 33 and len(b.eval_lens) == 18
    assert sum(e.calls for e in engines) - calls == n_engines            # one call per engine for both policies
    assert evaluate_together([a, b], [5, 3], engines) != alone             # control: each on the other's version


def test_refusals():
    engines = Engines([Engine()])
    a, b = producer(1, 4, engines), producer(2, 4, engines)
    with pytest.raises(ValueError, match=r"versions \[3, None\]"):
        evaluate_together([a, b], [3, None], engines)
    b.cfg.algo = SimpleNamespace(max_response_tokens=9, temperature=1.0)
    with pytest.raises(ValueError, match="different settings"):
        evaluate_together([a, b], [3, 4], engines)
