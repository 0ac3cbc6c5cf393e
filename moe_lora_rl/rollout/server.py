"""The rollout engine process: an offline vLLM CPU engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, our
worker extension, enforce_eager, routing capture on with prefix caching) behind a loopback HTTP server that serves
one request at a time:

    GET  /health                 200 once the engine is up (after a warm-up generate)
    POST /generate               {"prompts", "seeds", "max_tokens", "temperature", "stop_token_ids"} -> {"samples"}
    POST /collective_rpc         {"method", "args"} -> {"results": [...]}; as vLLM's dev endpoint, so the refit
                                 transports (HttpTransport, ShmTransport) push here unchanged
    POST /reset_prefix_cache     -> {"success": bool}
    GET  /status                 served adapter version and mode, capture meta, engine settings

    python -m moe_lora_rl.rollout.server --model DIR --port P [--dtype float32] [--serving unmerged] ...

Logprobs are vLLM's processed logprobs: log_softmax(logits / temperature) of the sampled token (temperature 0:
greedy, log_softmax(logits)). Routes are the worker extension's capture of each request, [prompt + response - 1,
n_moe_layers, topk] logical expert ids; incomplete routes are an error of the whole call. The prefix cache is reset
at the start of every /generate: a call's result depends only on the served weights and its own inputs (same
seeds, same tokens, also after a restart), while the samples of one prompt inside a call still share its blocks.
The server exits when its parent process is gone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer

from .engine import make_engine, set_engine_env
from .generate import captured_generate, start_capture
from .protocol import check_request, encode_routes


class Engine:
    """The vLLM engine and what the endpoints do with it."""

    def __init__(self, a):
        self.args = a
        self.llm = make_engine(a.model, dtype=a.dtype, seed=a.seed, max_model_len=a.max_model_len,
                               prefix_caching=a.prefix_caching, serving=a.serving, block_size=a.block_size,
                               logprobs_mode="processed_logprobs",
                               # a prompt is never split over engine steps: vLLM's sampler rewinds a seeded
                               # request's generator after a partial prefill (Generator.set_offset), which CPU
                               # generators refuse
                               enable_chunked_prefill=False, max_num_batched_tokens=max(8192, a.max_model_len))
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.meta = start_capture(self.llm) if a.capture else None
        # the first generate of a process pays seconds of one-time initialisation: here, not in the first rollout
        t0 = time.perf_counter()
        self.generate({"prompts": [[1, 2, 3]], "seeds": [0], "max_tokens": 2, "temperature": 1.0})
        print(f"warm-up generate: {time.perf_counter() - t0:.2f} s", flush=True)

    def rpc(self, method: str, args=(), kwargs=None):
        return self.llm.collective_rpc(method, args=tuple(args), kwargs=kwargs or {})

    def status(self) -> dict:
        a = self.args
        if self.meta is not None:
            self.meta = start_capture(self.llm)                  # already running: its current counters
        return {**self.rpc("moe_lora_status")[0], "pid": os.getpid(), "model": a.model, "dtype": a.dtype,
                "prefix_caching": a.prefix_caching, "capture": self.meta, "max_model_len": a.max_model_len,
                "block_size": a.block_size, "vocab_size": self.vocab}

    def generate(self, body: dict) -> dict:
        from vllm import SamplingParams

        prompts, seeds = body.get("prompts"), body.get("seeds")
        max_tokens, temperature = body.get("max_tokens"), body.get("temperature")
        stop = body.get("stop_token_ids")
        check_request(prompts, seeds, max_tokens, temperature, stop)
        for i, p in enumerate(prompts):
            if max(p) >= self.vocab:
                raise ValueError(f"prompts[{i}] has token id {max(p)} >= the vocabulary size {self.vocab}")
            if len(p) + max_tokens > self.args.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(p)} prompt tokens + max_tokens {max_tokens} exceed "
                                 f"max_model_len {self.args.max_model_len}")
        params = [SamplingParams(max_tokens=max_tokens, temperature=float(temperature), logprobs=0,
                                 seed=None if seeds is None else seeds[i], stop_token_ids=stop, detokenize=False)
                  for i in range(len(prompts))]
        if self.args.prefix_caching:
            self.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        gens = captured_generate(self.llm, prompts, params, self.meta)
        gen_s = time.perf_counter() - t0
        return {"samples": [{"response": g.response, "logprobs": g.logprobs, "finish_reason": g.finish_reason,
                             "routes": None if g.routes is None else encode_routes(g.routes)} for g in gens],
                "generate_s": gen_s}


def make_handler():
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so no client can hold this single-threaded server with keep-alive
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
            self._send(code, {"error": {"message": message, "type": "BadRequestError" if code == 400 else
                                        "InternalServerError", "param": None, "code": code}})

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            return json.loads(raw) if raw else {}

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"ok": True})
            elif self.path == "/status":
                self._send(200, self.server.engine.status())
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            path = self.path.split("?")[0]
            try:
                body = self._body()
            except ValueError as e:
                return self._error(400, f"JSON decode error: {e}")
            if path == "/generate":
                try:
                    self._send(200, self.server.engine.generate(body))
                except ValueError as e:
                    self._error(400, str(e))
                except Exception as e:  # noqa: BLE001 - reported to the client, the engine keeps serving
                    traceback.print_exc()
                    self._error(500, f"generate failed: {type(e).__name__}: {e}")
            elif path == "/collective_rpc":
                if not isinstance(body, dict) or body.get("method") is None:
                    return self._error(400, "Missing 'method' in request body")
                try:
                    results = self.server.engine.rpc(body["method"], body.get("args", []), body.get("kwargs"))
                except Exception as e:  # noqa: BLE001 - the message vLLM's engine core gives a failed utility call
                    traceback.print_exc()
                    return self._error(500, f"Call to collective_rpc method failed: {type(e).__name__}: {e}")
                self._send(200, {"results": [r if r is None or isinstance(r, (dict, list)) else str(r)
                                             for r in results]})
            elif path == "/reset_prefix_cache":
                self._send(200, {"success": bool(self.server.engine.llm.reset_prefix_cache())})
            else:
                self._error(404, f"no such endpoint: POST {path}")

    return Handler


class Server(HTTPServer):
    allow_reuse_address = True
    request_queue_size = 64                # senders of a streamed push wait their turn instead of being refused

    def __init__(self, addr, handler, parent_pid: int):
        super().__init__(addr, handler)
        self.parent_pid = parent_pid
        self.engine: Engine | None = None

    def handle_error(self, request, client_address):
        # a client that gave up waiting (a health check while the engine was starting) is not an error
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)

    def service_actions(self):
        # every poll interval while idle: exit with the process that started us
        if self.parent_pid and os.getppid() != self.parent_pid:
            print(f"parent process {self.parent_pid} is gone: exiting", flush=True)
            raise SystemExit(0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.rollout.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="listening address (another node's driver: 0.0.0.0)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--serving", default="unmerged", choices=("unmerged", "merged"))
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--capture", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32,
                    help="KV block size (the CPU attention backend needs a multiple of 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads of the engine (default: all cores)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is no longer the parent")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model {a.model}: not an HF checkpoint directory (no config.json)")
    for name in ("port", "max_model_len", "block_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    set_engine_env(a.threads)
    # the port first: a port in use fails in a second, not after the engine was built; health checks wait in the
    # listen queue until the engine is up
    server = Server((a.host, a.port), make_handler(), a.parent_pid)
    server.engine = Engine(a)
    print(f"rollout engine serving {a.model} on {a.host}:{a.port} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
