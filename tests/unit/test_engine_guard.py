"""What the engine server lets in, without vLLM (rollout/guard.py and the server's start-up refusals): the token
(environment or owner-only file, compared in full), the /collective_rpc allow-list, a non-loopback address without
a token refused at start, and the in-flight settings refused in one line before vLLM is built. The same refusals
against a running engine (401 / 400 / 413, the served adapter unchanged) are in tests/e2e/test_inflight.py."""
import os
import subprocess
import sys

import pytest

from moe_lora_rl.rollout import guard


def test_token_from_env_and_owner_only_file(tmp_path):
    assert guard.load_token(None, {}) is None
    assert guard.load_token(None, {guard.TOKEN_ENV: " abc "}) == "abc"
    with pytest.raises(ValueError, match=f"{guard.TOKEN_ENV} is set but empty"):
        guard.load_token(None, {guard.TOKEN_ENV: "  "})
    f = tmp_path / "tok"
    f.write_text("s3cret\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match=r"readable by others \(mode 0o644\)"):
        guard.load_token(str(f), {})
    f.chmod(0o600)
    assert guard.load_token(str(f), {guard.TOKEN_ENV: "other"}) == "s3cret"       # the file wins
    f.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        guard.load_token(str(f), {})


def test_authorized_compares_the_whole_bearer_token():
    tok = guard.new_token()
    assert len(tok) >= 40 and tok != guard.new_token()
    assert guard.authorized({"Authorization": f"Bearer {tok}"}, tok)
    for bad in ({}, {"Authorization": tok}, {"Authorization": f"Bearer {tok[:-1]}"},
                {"Authorization": f"Bearer {tok}x"}, {"Authorization": "Bearer "}):
        assert not guard.authorized(bad, tok), bad
    for h in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer None"}):
        assert not guard.authorized(h, None), h                  # an engine without a token serves /health only


@pytest.mark.parametrize("method", ["moe_lora_begin", "moe_lora_push_shm", "moe_lora_commit", "moe_lora_status"])
def test_transport_methods_are_allowed(method):
    assert guard.check_rpc(method) == method


@pytest.mark.parametrize("method", ["load_weights", "reload_weights", "moe_lora_capture_stop", "moe_lora_track",
                                    "__init__", "", None, 3])
def test_other_methods_are_refused(method):
    with pytest.raises(ValueError, match="is not callable over /collective_rpc"):
        guard.check_rpc(method)


def test_bind_rules():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        guard.check_bind(host, None)
    guard.check_bind("0.0.0.0", "t")
    with pytest.raises(ValueError, match="--host 0.0.0.0 is not a loopback address: the engine needs a token"):
        guard.check_bind("0.0.0.0", None)


def _server_args(tmp_path, *args, env=None, port=1):
    (tmp_path / "config.json").write_text("{}")
    e = {k: v for k, v in os.environ.items() if k != guard.TOKEN_ENV}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "moe_lora_rl.rollout.server", "--model", str(tmp_path),
                           "--port", str(port), *args], capture_output=True, text=True, timeout=120, env=e)


@pytest.mark.parametrize("args,needle", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0 is not a loopback address"),
    (["--inflight", "pin", "--serving", "merged"], "merged"),
    (["--inflight", "pin", "--max-versions", "0"], "0"),
    (["--max-body-mb", "0"], "--max-body-mb must be positive, got 0.0"),
])
def test_server_refuses_at_start_in_one_line(tmp_path, args, needle):
    proc = _server_args(tmp_path, *args)
    err = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and needle in err[-1] and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_non_loopback_with_a_token_passes_the_start_checks(tmp_path):
    import socket

    # passes the argument checks, then fails binding a port in use (before any engine is built)
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        proc = _server_args(tmp_path, "--host", "0.0.0.0", env={guard.TOKEN_ENV: "t"}, port=s.getsockname()[1])
    assert proc.returncode not in (0, 2) and "Address already in use" in proc.stderr, proc.stderr[-2000:]


class _StubEngine:
    def status(self):
        return {"version": 3}


def _serve(token):
    import threading

    from moe_lora_rl.rollout.endpoints import Server, make_handler

    srv = Server(("127.0.0.1", 0), make_handler(), parent_pid=os.getppid(), token=token)
    srv.engine = _StubEngine()
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


def _call(srv, method, path, token=None, body=None):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{srv.server_address[1]}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers=guard.auth_header(token))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_server_without_a_token_serves_health_only_on_loopback():
    srv = _serve(None)
    try:
        assert _call(srv, "GET", "/health") == (200, {"ok": True})
        for method, path, body in (("GET", "/status", None), ("POST", "/collective_rpc",
                                   {"method": "moe_lora_status", "args": [], "kwargs": {}}),
                                   ("POST", "/generate", {"prompts": [[1, 2]]})):
            for tok in (None, "guess"):
                code, reply = _call(srv, method, path, token=tok, body=body)
                assert code == 401 and reply["error"]["message"] == guard.NO_TOKEN, (path, tok, code, reply)
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_server_with_a_token_serves_its_holder_only():
    srv = _serve("s3cret")
    try:
        assert _call(srv, "GET", "/status", token="s3cret") == (200, {"version": 3})
        code, reply = _call(srv, "GET", "/status", token="s3cre")                        # control: a wrong token
        assert code == 401 and reply["error"]["message"] == "unauthorized"
        assert _call(srv, "GET", "/health") == (200, {"ok": True})
    finally:
        srv.shutdown()
        srv.server_close()
