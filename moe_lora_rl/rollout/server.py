"""The rollout engine process: a vLLM CPU engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, our worker
extension, enforce_eager, routing capture on with prefix caching) stepped continuously by one engine thread
(loop.py), behind a threaded HTTP server (endpoints.py): requests from any number of clients are batched together,
and adapter pushes land between two engine steps while other requests decode.

    GET  /health                 200 once the engine is up (after a warm-up generate); the only open endpoint
    POST /generate               {"prompts", "seeds", "max_tokens", "temperature", "stop_token_ids", "versions",
                                 "stream"} -> {"samples"}; stream: one JSON line per sample as it finishes
                                 ({"index", "sample"} or {"index", "error"})
    POST /collective_rpc         {"method", "args"} -> {"results": [...]}: the moe_lora_* methods of the adapter
                                 transports only (guard.RPC_METHODS), run between two engine steps
    POST /reset_prefix_cache     -> {"success": bool}: a no-op while requests run (the cache is keyed by version)
    GET  /status                 served versions and mode, the open stage (staged, stage_idle_s, stage_timeout_s,
                                 stages_expired), capture meta, engine settings, loop counters

    python -m moe_lora_rl.rollout.server --model DIR --port P [--dtype float32] [--serving unmerged]
        [--inflight switch|pin] [--max-versions N] [--on-full wait|refuse] [--stage-timeout-s S] [--token-file F] ...

An adapter stage with no begin or bucket for --stage-timeout-s seconds (a sender that died mid-push) is aborted by
the engine: a thread here asks the worker to expire it between two engine steps every min(S/4, 1) s (skipped while
a commit waits), one line in this log per expiry; the served version is untouched and the next push goes in.

Every endpoint but /health needs "Authorization: Bearer <token>" when the engine has a token (guard.py; given by
MOE_LORA_ENGINE_TOKEN or --token-file; required to bind a non-loopback address): refused with 401 and no detail.
A body over --max-body-mb is 413, a malformed one 400; the engine keeps serving.

Logprobs are vLLM's processed logprobs: log_softmax(logits / temperature) of the sampled token (temperature 0:
greedy, log_softmax(logits)). Routes are the worker extension's capture of each request, [prompt + response - 1,
n_moe_layers, topk] logical expert ids; a request with incomplete routes fails. versions: per response token, the
adapter version that produced it (loop.py). A sync /generate on an idle engine resets the prefix cache first: its
result depends only on the served weights and its own inputs (same seeds, same tokens, also after a restart), while
the samples of one prompt inside a call still share its blocks. The server exits when its parent process is gone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

from ..vllm.staged_push import DEFAULT_STAGE_TIMEOUT_S, check_stage_timeout
from . import guard
from .endpoints import Server, make_handler
from .vllm_engine import make_engine, set_engine_env
from .generate import start_capture
from .kv_compression import check_compression, engine_kwargs, install_method, verify
from .kv_meter import KVMeter
from .loop import EngineLoop
from .protocol import check_request
from .tickets import Request


class Engine:
    """The vLLM engine, its loop, and what the endpoints do with them."""

    def __init__(self, a):
        self.args = a
        extra = {"moe_lora_inflight": a.inflight, "moe_lora_on_full": a.on_full}
        if a.max_versions is not None:
            extra["moe_lora_max_versions"] = a.max_versions
        if a.expert_precision != "serving":
            extra["moe_lora_expert_precision"] = a.expert_precision
        kv = engine_kwargs(a.kv_compression, a.kv_budget, a.model_config)
        self.llm = make_engine(a.model, dtype=a.dtype, seed=a.seed, max_model_len=a.max_model_len, **kv,
                               prefix_caching=a.prefix_caching, serving=a.serving, block_size=a.block_size,
                               load_format=a.load_format,
                               logprobs_mode="processed_logprobs", additional_config=extra,
                               stage_timeout_s=a.stage_timeout_s,
                               # a prompt is never split over engine steps: vLLM's sampler rewinds a seeded
                               # request's generator after a partial prefill (Generator.set_offset), which CPU
                               # generators refuse; and the commit barrier of loop.py counts a prefill as one step
                               enable_chunked_prefill=False, max_num_batched_tokens=max(8192, a.max_model_len))
        self.has_base = a.load_format != "dummy"     # dummy: nothing is served until a base sync completed
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        verify(self.llm, a.kv_compression, a.kv_budget)
        self.evictor = install_method(self.llm, a.kv_compression, a.kv_budget, a.kv_evict, keep_events=a.kv_replay)
        self.kv = KVMeter(self.llm)
        self.meta = start_capture(self.llm) if a.capture else None
        self.loop = EngineLoop(self.llm, self.meta, inflight=a.inflight, on_full=a.on_full,
                               step_delay_s=a.step_delay_s, kv_meter=self.kv,
                               kv_records=self.evictor.pop_events if a.kv_replay else None).start()
        # the first generate of a process pays seconds of one-time initialisation: here, not in the first rollout
        t0 = time.perf_counter()
        self.loop.generate(self.requests({"prompts": [[1, 2, 3]], "seeds": [0], "max_tokens": 2, "temperature": 1.0},
                                         warm_up=True))
        print(f"warm-up generate: {time.perf_counter() - t0:.2f} s", flush=True)
        self.expire_every_s = min(a.stage_timeout_s / 4, 1.0)
        threading.Thread(target=self._expire_stages, name="stage-expiry", daemon=True).start()
        print(f"adapter stages expire after {a.stage_timeout_s:g} s without progress (stage_timeout_s; checked "
              f"every {self.expire_every_s:g} s)", flush=True)

    def _expire_stages(self) -> None:
        """Abandoned stages are aborted without waiting for a push: moe_lora_expire between two engine steps."""
        while self.loop.running():
            time.sleep(self.expire_every_s)
            try:
                self.loop.rpc("moe_lora_expire")
            except Exception:  # noqa: BLE001 - reported; the next check tries again
                if self.loop.running():
                    traceback.print_exc()

    def rpc(self, method: str, args=(), kwargs=None):
        return [self.loop.rpc(guard.check_rpc(method), args, kwargs)]

    def status(self) -> dict:
        a = self.args
        st = self.loop.rpc("moe_lora_status")
        if self.meta is not None:
            self.meta = self.loop.rpc("moe_lora_capture_start")     # already running: its current counters
        return {**st, "pid": os.getpid(), "model": a.model, "dtype": a.dtype, "prefix_caching": a.prefix_caching,
                "capture": self.meta, "max_model_len": a.max_model_len, "block_size": a.block_size,
                "vocab_size": self.vocab, "loop": dict(self.loop.stats), "in_flight": self.loop.in_flight(),
                "kv_compression": a.kv_compression, "kv_budget": a.kv_budget, "kv_evict": a.kv_evict,
                "kv": self.loop.call(lambda llm: self.kv.snapshot()),
                "kv_evictions": self.loop.call(lambda llm: self.evictor.stats()) if self.evictor else None}

    def requests(self, body: dict, warm_up: bool = False) -> list[Request]:
        from vllm import SamplingParams

        if not (self.has_base or warm_up):
            self.has_base = self.loop.rpc("moe_lora_base_status")["served"] is not None
            if not self.has_base:
                raise ValueError("this engine started empty (load_format=dummy) and has no base weights yet: "
                                 "sync the base first (transfer/shm_sender.py)")

        if not isinstance(body, dict):
            raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
        prompts, seeds = body.get("prompts"), body.get("seeds")
        max_tokens, temperature = body.get("max_tokens"), body.get("temperature")
        stop, versions = body.get("stop_token_ids"), body.get("versions")
        check_request(prompts, seeds, max_tokens, temperature, stop)
        if versions is not None and (not isinstance(versions, list) or len(versions) != len(prompts) or not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in versions)):
            raise ValueError(f"versions must be one version (int >= 0 or null) per prompt, got {versions!r:.80}")
        for i, p in enumerate(prompts):
            if max(p) >= self.vocab:
                raise ValueError(f"prompts[{i}] has token id {max(p)} >= the vocabulary size {self.vocab}")
            if len(p) + max_tokens > self.args.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(p)} prompt tokens + max_tokens {max_tokens} exceed "
                                 f"max_model_len {self.args.max_model_len}")
        return [Request(p, SamplingParams(max_tokens=max_tokens, temperature=float(temperature), logprobs=0,
                                          seed=None if seeds is None else seeds[i], stop_token_ids=stop,
                                          detokenize=False), None if versions is None else versions[i])
                for i, p in enumerate(prompts)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m moe_lora_rl.rollout.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="listening address (another node's driver: 0.0.0.0)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--serving", default="unmerged", choices=("unmerged", "merged"))
    ap.add_argument("--expert-precision", default="serving",
                    help="unmerged serving: the routed experts' GEMM dtype, serving or fp32 (vllm/moe_torch)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--capture", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32,
                    help="KV block size (the CPU attention backend needs a multiple of 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: start empty; nothing is served until the base was synced (transfer/)")
    ap.add_argument("--kv-compression", default="none",
                    help="KV compression of the rollouts (rollout/kv_compression.py): none, window or snapkv")
    ap.add_argument("--kv-evict", type=json.loads, default={},
                    help='snapkv settings as JSON, e.g. \'{"recent": 32, "interval": 16}\' (sinks, recent, window, '
                         'interval, pool)')
    ap.add_argument("--kv-budget", type=int, default=0, help="tokens of KV a sequence keeps (window: its length)")
    ap.add_argument("--kv-replay", action="store_true",
                    help="return each sample's eviction record (the tokens held per query) for the trainer to replay")
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads of the engine (default: all cores)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is no longer the parent")
    ap.add_argument("--inflight", default="switch", choices=("switch", "pin"),
                    help="a commit applies to running requests from their next step (switch), or they finish on "
                         "the version they started with (pin: unmerged serving only)")
    ap.add_argument("--max-versions", type=int, default=None,
                    help="adapter versions held at once (pin; default 2; switch holds 1)")
    ap.add_argument("--on-full", default="wait", choices=("wait", "refuse"),
                    help="a commit that would exceed --max-versions waits for a version to free, or is refused")
    ap.add_argument("--step-delay-s", type=float, default=0.0,
                    help="seconds added after every engine step: a slower engine, to test and measure back-pressure")
    ap.add_argument("--stage-timeout-s", type=float, default=DEFAULT_STAGE_TIMEOUT_S,
                    help="an adapter stage with no begin or bucket for this long (its sender died) is aborted by the "
                         "engine, so the next push goes in (default %(default)g)")
    ap.add_argument("--token-file", default=None,
                    help=f"file holding the shared secret (mode 600); default: ${guard.TOKEN_ENV}; without either the "
                         "server answers /health only")
    ap.add_argument("--max-body-mb", type=float, default=guard.DEFAULT_MAX_BODY / (1 << 20),
                    help="largest request body accepted (MiB)")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        ap.error(f"--model {a.model}: not an HF checkpoint directory (no config.json)")
    for name in ("port", "max_model_len", "block_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    try:
        a.model_config = json.loads(open(os.path.join(a.model, "config.json")).read())
        check_compression(a.kv_compression, a.kv_budget, a.max_model_len, a.model_config, a.kv_evict)
        if a.kv_replay and a.kv_compression != "snapkv":
            raise ValueError(f"--kv-replay replays importance eviction: --kv-compression is {a.kv_compression!r}, "
                             "not snapkv")
        if a.kv_compression == "snapkv" and a.prefix_caching:
            raise ValueError("--kv-compression snapkv needs --no-prefix-caching (compaction rewrites blocks in place)")
    except ValueError as e:
        ap.error(str(e))
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    if a.step_delay_s < 0:
        ap.error(f"--step-delay-s must be >= 0, got {a.step_delay_s}")
    if a.max_body_mb <= 0:
        ap.error(f"--max-body-mb must be positive, got {a.max_body_mb}")
    try:
        check_stage_timeout(a.stage_timeout_s, "--stage-timeout-s")
    except ValueError as e:
        ap.error(str(e))
    from ..vllm.versions import check_inflight_config
    from .expert_precision import check_expert_precision

    try:
        check_inflight_config(a.serving, a.inflight, a.max_versions, a.on_full)
        check_expert_precision(a.expert_precision, a.serving, "--expert-precision", "--serving")
        a.token = guard.load_token(a.token_file, os.environ)
        guard.check_bind(a.host, a.token)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    os.environ.pop(guard.TOKEN_ENV, None)            # read once; not inherited by anything this process starts
    set_engine_env(a.threads)
    # the port first: a port in use fails in a second, not after the engine was built; health checks wait in the
    # listen queue until the engine is up
    try:
        server = Server((a.host, a.port), make_handler(), a.parent_pid, a.token, int(a.max_body_mb * (1 << 20)))
    except OSError as e:
        print(f"rollout engine: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    server.engine = Engine(a)
    print(f"rollout engine serving {a.model} on {a.host}:{a.port} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
