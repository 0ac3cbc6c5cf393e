"""The rollout engine's pure parts, no vLLM: request checks (ValueError naming the value), the routes encoding,
the server's exit when its parent is gone, a server that cannot start reported as EngineDied (it binds its port
before building the engine), and the rollout bench's one-line refusals."""
import os

import numpy as np
import pytest

from moe_lora_rl.rollout.protocol import check_request, decode_routes, encode_routes
from moe_lora_rl.rollout.endpoints import Server

OK = dict(prompts=[[1, 2, 3]], seeds=[7], max_tokens=4, temperature=1.0, stop_token_ids=None)


@pytest.mark.parametrize("change,needle", [
    ({"prompts": []}, "prompts must be a non-empty list"),
    ({"prompts": [[1], []]}, "prompts[1] is empty"),
    ({"prompts": [[1, -1]]}, "prompts[0] has a token id"),
    ({"prompts": [[1, 2.5]]}, "prompts[0] has a token id"),
    ({"seeds": [1, 2]}, "seeds must be one int per prompt (1), got 2"),
    ({"seeds": ["a"]}, "seeds must be ints"),
    ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
    ({"max_tokens": 2.0}, "max_tokens must be an int >= 1, got 2.0"),
    ({"temperature": -0.5}, "temperature must be a number >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan"),
    ({"stop_token_ids": [1, None]}, "stop_token_ids must be a list of token ids"),
])
def test_bad_requests_name_the_value(change, needle):
    with pytest.raises(ValueError) as e:
        check_request(**{**OK, **change})
    assert needle in str(e.value)


def test_good_requests_pass():
    check_request(**OK)
    check_request(**{**OK, "seeds": None, "temperature": 0, "stop_token_ids": [2]})


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routes_round_trip(dtype):
    r = np.random.default_rng(0).integers(0, 250, (37, 3, 4)).astype(dtype)
    enc = encode_routes(r)
    back = decode_routes(enc)
    assert back.dtype == dtype and back.shape == r.shape and (back == r).all()
    assert len(enc["b64"]) <= 4 * r.nbytes / 3 + 4                       # raw bytes, not a JSON list of ints
    assert decode_routes(None) is None


def test_server_exits_when_its_parent_is_gone():
    from http.server import BaseHTTPRequestHandler

    srv = Server(("127.0.0.1", 0), BaseHTTPRequestHandler, parent_pid=os.getppid() + 10 ** 7)
    try:
        with pytest.raises(SystemExit):
            srv.serve_forever(poll_interval=0.05)
    finally:
        srv.server_close()
    srv = Server(("127.0.0.1", 0), BaseHTTPRequestHandler, parent_pid=os.getppid())     # control: parent alive
    srv.service_actions()
    srv.server_close()


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "fp8"], "--dtype 'fp8': choose one of"),
    (["--requests", "10", "--group", "4"], "--requests 10 is not a multiple of --group 4"),
    (["--threads", "1,x"], "--threads '1,x': expected comma-separated integers"),
    (["--model", "/nonexistent"], "--model /nonexistent: not an HF checkpoint"),
])
def test_bench_refuses_in_one_line(argv, needle, capsys):
    """In process, through the bench CLI's main (tests/unit/test_bench_cli.py checks the process itself once)."""
    from moe_lora_rl.bench.__main__ import main

    try:
        rc = main(["rollout", *argv])
    except SystemExit as e:                          # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], err[-2000:]


def test_engine_that_cannot_start_is_engine_died(tmp_path):
    import socket

    from moe_lora_rl.rollout.client import EngineDied, RolloutEngine

    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineDied, match=r"exited with code 1;[\s\S]*Address already in use"):
            RolloutEngine.start(tmp_path, log_dir=tmp_path, port=port, startup_timeout=60)


def test_client_takes_integer_arrays_and_refuses_floats_before_sending(tmp_path):
    import torch

    from moe_lora_rl.rollout.client import EngineDied, RolloutEngine

    (tmp_path / "config.json").write_text("{}")
    never_started = RolloutEngine(tmp_path, log_dir=tmp_path)
    with pytest.raises(EngineDied, match="stopped"):          # valid: numpy / torch integer ids reach the process
        never_started.generate([np.array([1, 2]), torch.tensor([3, 4])], seeds=np.array([1, 2]), max_tokens=2,
                               temperature=1.0)
    with pytest.raises(ValueError, match="prompts\\[0\\] has a token id"):
        never_started.generate([[1.0, 2.0]], seeds=None, max_tokens=2, temperature=1.0)


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), "600"])
def test_stage_timeout_refused_in_one_line_before_anything_starts(tmp_path, bad):
    from moe_lora_rl.rollout.client import RolloutEngine

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"^stage_timeout_s must be > 0, got {bad!r}$"):
        RolloutEngine(tmp_path, log_dir=tmp_path, stage_timeout_s=bad)
    assert RolloutEngine(tmp_path, log_dir=tmp_path).settings["stage_timeout_s"] == 600.0     # the default


@pytest.mark.parametrize("value,needle", [("0", "--stage-timeout-s must be > 0, got 0.0"),
                                          ("-1", "--stage-timeout-s must be > 0, got -1.0"),
                                          ("nan", "--stage-timeout-s must be > 0, got nan"),
                                          ("soon", "argument --stage-timeout-s: invalid float value: 'soon'")])
def test_server_refuses_a_bad_stage_timeout(tmp_path, capsys, value, needle):
    from moe_lora_rl.rollout.server import parse_args

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", str(tmp_path), "--port", "1", "--stage-timeout-s", value])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert e.value.code == 2 and needle in err[-1], err
    assert parse_args(["--model", str(tmp_path), "--port", "1"]).stage_timeout_s == 600.0
    assert parse_args(["--model", str(tmp_path), "--port", "1", "--stage-timeout-s", "2.5"]).stage_timeout_s == 2.5


def test_stage_expiry_is_skipped_while_a_commit_waits():
    """The engine loop answers moe_lora_expire with None, without calling the worker, while a commit waits for room
    (pin, on_full=wait): the stage that commit closes is not abandoned. Once the commit landed, expiry runs again."""
    import threading
    import time

    from moe_lora_rl.rollout.loop import EngineLoop

    class LLM:                                              # a worker with no requests: commands only
        llm_engine = object()

        def __init__(self):
            self.version, self.can_commit, self.calls = None, False, []

        def collective_rpc(self, method, args=(), kwargs=None):
            self.calls.append(method)
            if method == "moe_lora_push":
                self.version = args[0]
                return [{"version": args[0]}]
            if method == "moe_lora_expire":
                return [{"expired": None}]
            return [{"version": self.version, "can_commit": self.can_commit}]

    llm = LLM()
    loop = EngineLoop(llm, inflight="pin", on_full="wait").start()
    try:
        assert loop.rpc("moe_lora_expire") == {"expired": None}            # control: nothing waits, it runs
        push = threading.Thread(target=loop.rpc, args=("moe_lora_push", (3,)))
        push.start()
        while llm.calls.count("moe_lora_status") < 2:                      # the push found no room: deferred
            time.sleep(0.005)
        assert push.is_alive() and loop.rpc("moe_lora_expire", timeout=10) is None
        assert llm.calls.count("moe_lora_expire") == 1 and llm.version is None
        llm.can_commit = True
        push.join(10)
        assert llm.version == 3 and loop.rpc("moe_lora_expire") == {"expired": None}
        assert llm.calls.count("moe_lora_expire") == 2
    finally:
        loop.stop()


def test_snapkv_engine_settings(tmp_path, capsys):
    """snapkv runs without prefix caching (the client turns it off; a server asked for it refuses), its settings
    travel to the server, and bad ones are refused before anything starts."""
    from moe_lora_rl.rollout.client import RolloutEngine
    from moe_lora_rl.rollout.server import parse_args

    (tmp_path / "config.json").write_text("{}")
    e = RolloutEngine(tmp_path, log_dir=tmp_path, kv_compression="snapkv", kv_budget=64, kv_evict={"recent": 16})
    assert e.settings["prefix_caching"] is False and e.settings["kv_evict"] == {"recent": 16}
    with pytest.raises(ValueError, match="kv_budget=36 is not above the sinks plus the recent window"):
        RolloutEngine(tmp_path, log_dir=tmp_path, kv_compression="snapkv", kv_budget=36)
    base = ["--model", str(tmp_path), "--port", "1", "--kv-compression", "snapkv", "--kv-budget", "64"]
    a = parse_args([*base, "--no-prefix-caching", "--kv-evict", '{"recent": 16, "interval": 4}'])
    assert a.kv_evict == {"recent": 16, "interval": 4} and not a.kv_replay
    assert parse_args([*base, "--no-prefix-caching", "--kv-replay"]).kv_replay
    e = RolloutEngine(tmp_path, log_dir=tmp_path, kv_compression="snapkv", kv_budget=64, kv_replay=True)
    assert e.settings["kv_replay"] is True
    with pytest.raises(ValueError, match="kv_replay=True replays importance eviction: kv_compression='window'"):
        RolloutEngine(tmp_path, log_dir=tmp_path, kv_compression="window", kv_budget=64, kv_replay=True)
    window = ["--model", str(tmp_path), "--port", "1", "--kv-compression", "window", "--kv-budget", "64"]
    for argv, needle in (([*base], "--kv-compression snapkv needs --no-prefix-caching"),
                         ([*base, "--no-prefix-caching", "--kv-evict", '{"interval": 0}'], "interval=0 is below 1"),
                         ([*window, "--kv-replay"], "--kv-replay replays importance eviction: --kv-compression is "
                                                    "'window'")):
        with pytest.raises(SystemExit) as ex:
            parse_args(argv)
        err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
        assert ex.value.code == 2 and needle in err[-1], err


def test_expert_precision_travels_to_the_engine_and_is_refused_with_merged(tmp_path, monkeypatch):
    """rollout.expert_precision=fp32: the client passes --expert-precision fp32 to the server, the server gives it
    to the worker extension (additional_config moe_lora_expert_precision); the default passes nothing; with merged
    serving it is refused in one line by the config, the client and the server."""
    import subprocess

    from moe_lora_rl.rl.config import load
    from moe_lora_rl.rollout import server
    from moe_lora_rl.rollout.client import RolloutEngine

    (tmp_path / "config.json").write_text("{}")
    cmds = []

    class Stop(Exception):
        pass

    def popen(cmd, **kw):
        cmds.append(cmd)
        raise Stop

    monkeypatch.setattr(subprocess, "Popen", popen)
    for prec in ("fp32", "serving"):
        with pytest.raises(Stop):
            RolloutEngine(tmp_path, log_dir=tmp_path, expert_precision=prec).launch()
    assert cmds[0][cmds[0].index("--expert-precision") + 1] == "fp32" and "--expert-precision" not in cmds[1]
    seen = []

    def make_engine(model, **kw):
        seen.append(kw["additional_config"])
        raise Stop

    monkeypatch.setattr(server, "make_engine", make_engine)
    argv = ["--model", str(tmp_path), "--port", "1"]
    for extra in (["--expert-precision", "fp32"], []):
        with pytest.raises(Stop):
            server.Engine(server.parse_args([*argv, *extra]))
    assert seen[0]["moe_lora_expert_precision"] == "fp32" and "moe_lora_expert_precision" not in seen[1]
    with pytest.raises(ValueError, match="expert_precision=fp32 with serving=merged"):
        RolloutEngine(tmp_path, log_dir=tmp_path, serving="merged", expert_precision="fp32")
    with pytest.raises(SystemExit):
        server.parse_args([*argv, "--serving", "merged", "--expert-precision", "fp32"])
    with pytest.raises(SystemExit):
        server.parse_args([*argv, "--expert-precision", "bf16"])
    with pytest.raises(ValueError, match="expert_precision='bf16'"):
        RolloutEngine(tmp_path, log_dir=tmp_path, expert_precision="bf16")
    with pytest.raises(ValueError, match="rollout.expert_precision=fp32 with serving=merged"):
        load(["serving=merged", "rollout.expert_precision=fp32"])
    assert load(["rollout.expert_precision=fp32"]).rollout.expert_precision == "fp32"
