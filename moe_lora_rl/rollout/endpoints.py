"""The engine process's HTTP side (server.py builds the engine and runs it): the request handler of every endpoint
and the threaded server, which exits when the process that started it is gone. The endpoints are listed in
server.py; what they run is the Engine's (server.Engine: requests, rpc, status, its loop).

    server = Server((host, port), make_handler(), parent_pid, token, max_body)
    server.engine = Engine(args)                     # the handler reads it from the server
    server.serve_forever(poll_interval=0.5)
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import guard
from .protocol import encode_routes


def sample_json(g) -> dict:
    return {"response": g.response, "logprobs": g.logprobs, "finish_reason": g.finish_reason,
            "routes": None if g.routes is None else encode_routes(g.routes), "versions": g.versions,
            "kv_kept": g.kv_kept}


def _error_message(e: BaseException) -> tuple[int, str]:
    if isinstance(e, ValueError):
        return 400, str(e)
    return 500, f"generate failed: {type(e).__name__}: {e}"


def make_handler():
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection; a stream ends when the connection closes
        protocol_version = "HTTP/1.0"

        def log_message(self, fmt, *args):          # one line per request on stderr is noise at RL step rates
            pass

        def _send(self, code: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str) -> None:
            # the error body of vLLM's OpenAI server (ErrorResponse)
            kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    413: "RequestTooLarge"}.get(code, "InternalServerError")
            self._send(code, {"error": {"message": message, "type": kind, "param": None, "code": code}})

        def _authorized(self) -> bool:
            if guard.authorized(self.headers, self.server.token):
                return True
            self._error(401, guard.NO_TOKEN if self.server.token is None else "unauthorized")
            return False

        def _body(self):
            """The JSON body, or None after an error reply (413: too large, 400: not JSON)."""
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0 or n > self.server.max_body:
                self.close_connection = True
                self._discard(n)
                self._error(413 if n > 0 else 400, f"request body of {self.headers.get('Content-Length')} "
                            f"bytes: the limit is {self.server.max_body}")
                return None
            raw = self.rfile.read(n) if n else b""
            try:
                return json.loads(raw) if raw else {}
            except ValueError as e:
                self._error(400, f"JSON decode error: {e}")
                return None

        def _discard(self, n: int) -> None:
            """Read and drop an oversized body of up to DRAIN_FACTOR x the limit in small chunks before the 413, so
            that the client, still sending, reads the reply instead of a reset connection; a larger one is not read
            (the connection closes under it)."""
            left = n if 0 < n <= guard.DRAIN_FACTOR * self.server.max_body else 0
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"ok": True})
            if not self._authorized():
                return
            if self.path == "/status":
                self._send(200, self.server.engine.status())
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            path = self.path.split("?")[0]
            if not self._authorized():
                return
            body = self._body()
            if body is None:
                return
            engine = self.server.engine
            if path == "/generate":
                try:
                    reqs = engine.requests(body)
                except ValueError as e:
                    return self._error(400, str(e))
                if body.get("stream"):
                    return self._stream(reqs)
                try:
                    t0 = time.perf_counter()
                    gens = engine.loop.generate(reqs)
                    self._send(200, {"samples": [sample_json(g) for g in gens],
                                     "generate_s": time.perf_counter() - t0})
                except Exception as e:  # noqa: BLE001 - reported to the client, the engine keeps serving
                    if not isinstance(e, ValueError):
                        traceback.print_exc()
                    self._error(*_error_message(e))
            elif path == "/collective_rpc":
                if not isinstance(body, dict) or body.get("method") is None:
                    return self._error(400, "Missing 'method' in request body")
                try:
                    guard.check_rpc(body["method"])
                    args, kwargs = body.get("args", []), body.get("kwargs") or {}
                    if not isinstance(args, list) or not isinstance(kwargs, dict):
                        raise ValueError("'args' must be a list and 'kwargs' an object")
                except ValueError as e:
                    return self._error(400, str(e))
                try:
                    results = engine.rpc(body["method"], args, kwargs)
                except Exception as e:  # noqa: BLE001 - the message vLLM's engine core gives a failed utility call
                    if not isinstance(e, ValueError):
                        traceback.print_exc()
                    return self._error(500, f"Call to collective_rpc method failed: {type(e).__name__}: {e}")
                self._send(200, {"results": [r if r is None or isinstance(r, (dict, list)) else str(r)
                                             for r in results]})
            elif path == "/reset_prefix_cache":
                self._send(200, {"success": bool(engine.loop.call(
                    lambda llm: engine.loop.in_flight() == 0 and llm.reset_prefix_cache()))})
            else:
                self._error(404, f"no such endpoint: POST {path}")

        def _stream(self, reqs) -> None:
            loop = self.server.engine.loop
            ticket = loop.submit(reqs)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            try:
                for index, r in ticket:
                    line = ({"index": index, "error": _error_message(r)[1]} if isinstance(r, BaseException)
                            else {"index": index, "sample": sample_json(r)})
                    self.wfile.write(json.dumps(line).encode() + b"\n")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                loop.abort(ticket)                     # the client is gone: its requests stop decoding

    return Handler


class Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 64                # senders of a streamed push wait their turn instead of being refused

    def __init__(self, addr, handler, parent_pid: int, token: str | None = None,
                 max_body: int = guard.DEFAULT_MAX_BODY):
        super().__init__(addr, handler)
        self.parent_pid, self.token, self.max_body = parent_pid, token, max_body
        self.engine = None                 # server.Engine, set once it is built

    def handle_error(self, request, client_address):
        # a client that gave up waiting (a health check while the engine was starting) is not an error
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    def service_actions(self):
        # every poll interval: exit with the process that started us
        if self.parent_pid and os.getppid() != self.parent_pid:
            print(f"parent process {self.parent_pid} is gone: exiting", flush=True)
            raise SystemExit(0)
