"""Stages that expire (vllm/staged_push.py, moe_lora_expire run by the engine server between steps), one engine process
on the tiny glm4_moe (fp32) with stage_timeout_s=3:

- version 1 is pushed and served;
- version 2's stage is opened over HTTP without a sender pid (transfer's HttpTransport: a begin of 2 buckets and
  bucket 0), then abandoned, as by a trainer on another host that died mid-push;
- negative control: while that stage is fresh, a push of version 3 is refused naming version 2 (status: staged 2);
- with no further push, the engine aborts the stage once it had no progress for the timeout: one line in its log
  (version, seconds idle >= the timeout, the timeout), /status shows nothing staged, one stage expired and version 1
  still served;
- the push of version 3 then commits: /status serves version 3, and a generate's tokens are stamped version 3.
"""
import re
import time

import pytest

pytestmark = pytest.mark.vllm

RANK, ALPHA = 4, 8.0
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    from moe_lora_rl.rollout.client import RolloutEngine

    eng = RolloutEngine.start(model, dtype="float32", capture=False, log_dir=tmp_path_factory.mktemp("engine"),
                              stage_timeout_s=TIMEOUT_S)
    yield eng
    eng.stop()


def test_abandoned_stage_expires_and_the_next_push_commits(engine, arch):
    from moe_lora_rl.checks.route_reference import random_expert_adapter
    from moe_lora_rl.transfer.transports import HttpTransport

    adapters = {v: random_expert_adapter(arch, RANK, seed=60 + v) for v in (1, 2, 3)}
    st = engine.status()
    assert st["stage_timeout_s"] == TIMEOUT_S and st["staged"] is None and st["stages_expired"] == 0
    assert f"adapter stages expire after {TIMEOUT_S:g} s without progress" in engine.log_path.read_text()
    assert engine.transport.push(1, adapters[1], RANK, ALPHA).served["version"] == 1

    # a sender on another host: no pid at begin; it sends bucket 0 of 2 and is gone
    http = HttpTransport(f"http://127.0.0.1:{engine.port}", token=engine.token)
    names = sorted(adapters[2])
    http.call("moe_lora_begin", 2, None, RANK, ALPHA, 2)
    http.send_bucket(2, 0, {n: adapters[2][n] for n in names[:len(names) // 2]})
    abandoned_at = time.monotonic()
    with pytest.raises(ValueError, match="cannot begin version 3: version 2 is staged"):
        engine.transport.push(3, adapters[3], RANK, ALPHA)           # control: a fresh stage is still refused
    st = engine.status()
    assert (st["staged"], st["version"], st["stages_expired"]) == (2, 1, 0)

    # no push now: the engine's own periodic check aborts the stage
    while engine.status()["staged"] is not None:
        assert time.monotonic() - abandoned_at < TIMEOUT_S + 30, "the abandoned stage never expired"
        time.sleep(0.2)
    assert time.monotonic() - abandoned_at >= TIMEOUT_S
    st = engine.status()
    assert (st["staged"], st["version"], st["stages_expired"]) == (None, 1, 1)
    lines = [l for l in engine.log_path.read_text().splitlines() if "expired: no progress" in l]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"moe_lora: stage of adapter version 2 expired: no progress for ([\d.]+) s "
                     r"\(stage_timeout_s 3, 1/2 buckets received\); aborted, version 1 stays served", lines[0])
    assert m and float(m.group(1)) >= TIMEOUT_S, lines[0]

    assert engine.transport.push(3, adapters[3], RANK, ALPHA).served["version"] == 3
    assert engine.status()["version"] == 3
    [sample] = engine.generate([[5, 6, 7, 8]], seeds=[0], max_tokens=3, temperature=1.0)
    assert sample.versions == [3] * len(sample.response)
