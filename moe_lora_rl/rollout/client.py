"""The rollout engine client: starts the engine process (rollout/server.py) on a free loopback port with its own
log file, generates samples with per-token logprobs and captured routes, exposes a Transport for adapter pushes
(engine_transport.py: shared memory on this host, inline HTTP for an engine on another),
and knows when the process died.

    engine = RolloutEngine.start(model_dir, dtype="float32", log_dir=run_dir)    # inflight="pin", max_versions=...
                                                                              # stage_timeout_s=600.0 (the default)
    samples = engine.generate(prompts, seeds=seeds, max_tokens=64, temperature=1.0, stop_token_ids=[eos])
    for i, sample in engine.stream(prompts, seeds=seeds, max_tokens=64, temperature=1.0): ...   # as they finish
    push_stream(model, arch, engine.transport, version, rank, alpha)      # or engine.transport.push(...)
    engine.busy_s                                                        # generate + push seconds so far

Samples carry per-token adapter versions. Every call but /health carries the engine's token (generated per engine
object, handed to the process in its environment). Several threads may generate and stream at once, beside one
thread pushing.

Every call first checks the process: a dead engine is EngineDied (exit code and log tail), never a hang or a
connection error. restart() starts a fresh process on the same port with the same settings: it serves the base
model (push the current adapter again). Bad arguments are a ValueError before anything is sent.

stage_timeout_s: an adapter stage with no begin or bucket for that long (its sender died mid-push) is aborted by the
engine itself, so later pushes are not refused forever (vllm/staged_push.py; default DEFAULT_STAGE_TIMEOUT_S, 600 s).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..procs import free_port
from ..vllm.staged_push import DEFAULT_STAGE_TIMEOUT_S, check_stage_timeout
from .vllm_engine import engine_env
from .engine_transport import EngineHttpTransport, EngineTransport
from .expert_precision import check_expert_precision
from .guard import TOKEN_ENV, auth_header, new_token
from .placement import Placement
from .protocol import Sample, as_ints, check_request, decode_sample


class EngineDied(RuntimeError):
    """The engine process is gone (exit code and log tail in the message)."""


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


DEFAULT_MAX_MODEL_LEN = 512          # tokens of context of an engine the driver starts


class RolloutEngine:
    def __init__(self, model_dir, *, dtype="bfloat16", serving="unmerged", prefix_caching=True, capture=True,
                 log_dir=".", max_model_len=DEFAULT_MAX_MODEL_LEN, seed=0, startup_timeout=300.0, block_size=32,
                 threads: int | None = None, port: int | None = None, request_timeout=600.0,
                 placement: "Placement | None" = None, inflight: str = "switch", max_versions: int | None = None,
                 on_full: str = "wait", max_body_mb: float | None = None, step_delay_s: float = 0.0,
                 stage_timeout_s: float = DEFAULT_STAGE_TIMEOUT_S, kv_compression: str = "none", kv_budget: int = 0,
                 kv_evict: dict | None = None, kv_replay: bool = False, base_from: str = "disk",
                 base_bucket_mb: float = 64.0, base_transport: str = "auto", expert_precision: str = "serving"):
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir {model_dir}: not an HF checkpoint directory (no config.json)")
        if dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype={dtype!r}: expected bfloat16, float32 or float16")
        if serving not in ("unmerged", "merged"):
            raise ValueError(f"serving={serving!r}: expected 'unmerged' or 'merged'")
        for name, v in (("max_model_len", max_model_len), ("block_size", block_size),
                        ("startup_timeout", startup_timeout)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        from ..vllm.versions import check_inflight_config

        check_inflight_config(serving, inflight, max_versions, on_full)
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
        stage_timeout_s = check_stage_timeout(stage_timeout_s)
        if base_from not in ("disk", "trainer", "peer"):
            raise ValueError(f"base_from={base_from!r}: expected 'disk', 'trainer' or 'peer'")
        check_expert_precision(expert_precision, serving)
        if base_from == "peer" and serving == "merged":
            raise ValueError("base_from='peer' with serving='merged': a peer's base tensors hold its merged adapter")
        self.placement = placement or Placement()
        from .base import check_base_transport

        check_base_transport(base_from, base_transport, base_bucket_mb, self.placement, max_body_mb)
        from .kv_compression import check_compression

        kv_evict = dict(kv_evict or {})
        check_compression(kv_compression, kv_budget, max_model_len,
                          json.loads((Path(model_dir) / "config.json").read_text()), kv_evict)
        if kv_replay and kv_compression != "snapkv":
            raise ValueError(f"kv_replay=True replays importance eviction: kv_compression={kv_compression!r} is not "
                             "snapkv")
        if kv_compression == "snapkv":
            prefix_caching = False              # compaction rewrites a sequence's blocks in place: none is shared
        self.model_dir, self.log_dir = str(model_dir), Path(log_dir)
        self.settings = dict(dtype=dtype, serving=serving, prefix_caching=prefix_caching, capture=capture,
                             max_model_len=max_model_len, seed=seed, block_size=block_size, threads=threads,
                             inflight=inflight, max_versions=max_versions, on_full=on_full, max_body_mb=max_body_mb,
                             step_delay_s=step_delay_s, stage_timeout_s=stage_timeout_s,
                             kv_compression=kv_compression, kv_budget=kv_budget, kv_evict=kv_evict,
                             kv_replay=kv_replay, base_from=base_from, expert_precision=expert_precision,
                             base_bucket_mb=base_bucket_mb, base_transport=base_transport)
        self.base_syncs: list[dict] = []     # base_from=trainer or peer: each start's sync timers
        self.base_store = None               # the trainer's base in shared memory, kept across restarts
        self.owns_base = True                # False: the store is shared by several engines (rollout/replicas.py)
        self.peers = lambda: []              # base_from=peer: the other engines (set by rollout/replicas.py)
        self.token = new_token()             # per engine object: every call but /health carries it
        self.startup_timeout, self.request_timeout = startup_timeout, request_timeout
        self.generate_s = self.push_s = 0.0
        self.started_at = None
        self.port = port                     # None: a free port, chosen at the first start and kept on restarts
        self.proc: subprocess.Popen | None = None
        self.transport: EngineTransport | None = None
        self.log_path: Path | None = None
        self.restarts = 0

    # -- process ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, model_dir, *, dtype="bfloat16", serving="unmerged", prefix_caching=True, capture=True,
              log_dir=".", max_model_len=DEFAULT_MAX_MODEL_LEN, seed=0, startup_timeout=300, **kw) -> "RolloutEngine":
        engine = cls(model_dir, dtype=dtype, serving=serving, prefix_caching=prefix_caching, capture=capture,
                     log_dir=log_dir, max_model_len=max_model_len, seed=seed, startup_timeout=startup_timeout, **kw)
        engine.launch()
        return engine

    def launch(self, sync: bool = True) -> None:
        """Start the engine process and wait for its health; then, unless not sync, send it its base (base_from
        trainer or peer)."""
        s = self.settings
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port()
        self.log_path = self.log_dir / f"rollout-engine-{self.port}.log"
        pl = self.placement
        cmd = [*pl.launcher, sys.executable, "-m", "moe_lora_rl.rollout.server", "--model", self.model_dir,
               "--port", str(self.port), "--host", pl.bind_host, "--dtype", s["dtype"], "--serving", s["serving"],
               "--max-model-len", str(s["max_model_len"]), "--block-size", str(s["block_size"]),
               "--seed", str(s["seed"]), "--parent-pid", str(os.getpid() if pl.watch_parent else 0),
               "--prefix-caching" if s["prefix_caching"] else "--no-prefix-caching",
               "--capture" if s["capture"] else "--no-capture", "--inflight", s["inflight"],
               "--on-full", s["on_full"], "--stage-timeout-s", repr(s["stage_timeout_s"])]
        if s["threads"] is not None:
            cmd += ["--threads", str(s["threads"])]
        if s["max_versions"] is not None:
            cmd += ["--max-versions", str(s["max_versions"])]
        if s["max_body_mb"] is not None:
            cmd += ["--max-body-mb", str(s["max_body_mb"])]
        if s["step_delay_s"]:
            cmd += ["--step-delay-s", str(s["step_delay_s"])]
        if s["kv_compression"] != "none":
            cmd += ["--kv-compression", s["kv_compression"], "--kv-budget", str(s["kv_budget"])]
        if s["kv_evict"]:
            cmd += ["--kv-evict", json.dumps(s["kv_evict"])]
        if s["kv_replay"]:
            cmd += ["--kv-replay"]
        if s["expert_precision"] != "serving":
            cmd += ["--expert-precision", s["expert_precision"]]
        if s["base_from"] in ("trainer", "peer"):
            cmd += ["--load-format", "dummy"]
        env = dict(os.environ, **engine_env(s["threads"]), **pl.env, **{TOKEN_ENV: self.token})
        if s["threads"] is None:
            env.pop("OMP_NUM_THREADS", None)            # e.g. torchrun's 1: the engine uses the cores while it runs
        with open(self.log_path, "ab") as log:
            # cwd: the log folder, where no folder shadows our package (the vLLM plugin would not load)
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.log_dir,
                                         stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        url = f"http://{pl.connect_host}:{self.port}"
        if self.transport is None:
            self.transport = (EngineTransport if pl.transport == "shm" else EngineHttpTransport)(self, url)
        self.transport.base_url = url
        t0 = time.time()
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.time() - t0 > self.startup_timeout:
                self.stop()
                raise EngineDied(f"rollout engine did not become healthy within {self.startup_timeout} s "
                                 f"(stopped); log {self.log_path}:\n{self._log_tail()}")
            time.sleep(0.5)
        if sync and s["base_from"] == "peer" and self.restarts:
            self.sync_base_from_peer()
        elif sync and s["base_from"] in ("trainer", "peer"):
            self.sync_base()
        self.started_at = time.time()

    def base_transport(self) -> str:
        """How the base reaches this engine (rollout/base.py): shm, http or gloo."""
        from .base import resolve_transport

        return resolve_transport(self.settings["base_transport"], self.placement)

    def sync_base(self) -> dict:
        """The trainer's base into this engine, which started empty (rollout/base.py); the timers."""
        from .base import sync_base

        return sync_base(self)

    def sync_base_from_peer(self) -> dict:
        """The base a live peer engine keeps into this engine, which started empty (rollout/base.py); the timers."""
        from .base import sync_from_peer

        return sync_from_peer(self)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _check_alive(self) -> None:
        if self.proc is None:
            raise EngineDied("rollout engine is stopped (start() or restart() it)")
        code = self.proc.poll()
        if code is not None:
            raise EngineDied(f"rollout engine (pid {self.proc.pid}) exited with code {_signal_name(code)}; "
                             f"log {self.log_path}, last lines:\n{self._log_tail()}")

    def stop(self, keep_base: bool = False) -> None:
        """Stop the process and remove this client's shared-memory segments, the base's too unless keep_base (a
        restart); idempotent, also run at interpreter exit."""
        atexit.unregister(self.stop)
        if self.base_store is not None and not keep_base:
            if self.owns_base:
                self.base_store.close()
            self.base_store = None
        if self.transport is not None:
            self.transport.close()
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def restart(self) -> None:
        """A fresh engine process with the same settings and port; it serves the base model until the next push."""
        self.stop(keep_base=True)
        self.restarts += 1
        self.launch()

    # -- requests --------------------------------------------------------------------------------------------
    def _open(self, method: str, path: str, body: dict | None = None):
        """The HTTP answer of the engine (to be closed by the caller); errors as ValueError (refused, 400),
        RuntimeError, or EngineDied."""
        self._check_alive()
        data = None if body is None else json.dumps(body).encode()
        url = f"http://{self.placement.connect_host}:{self.port}{path}"
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **auth_header(self.token)})
        try:
            return urllib.request.urlopen(req, timeout=self.request_timeout)
        except urllib.error.HTTPError as e:
            raw = e.read().decode(errors="replace")
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:2000]
            if e.code == 400:
                raise ValueError(f"rollout engine refused {path}: {msg}") from e
            raise RuntimeError(f"rollout engine {path} failed (HTTP {e.code}): {msg}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            self._no_answer(path, e)

    def _no_answer(self, path: str, e: BaseException):
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._check_alive()
        raise RuntimeError(f"rollout engine {path}: no answer from pid {self.pid} on port {self.port}: {e}") from e

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        with self._open(method, path, body) as r:
            try:
                return json.loads(r.read())
            except (ConnectionError, TimeoutError, OSError) as e:
                self._no_answer(path, e)

    def _body(self, prompts, seeds, max_tokens, temperature, stop_token_ids, versions) -> dict:
        prompts = [as_ints(p) for p in prompts] if isinstance(prompts, (list, tuple)) else prompts
        seeds, stop = as_ints(seeds), as_ints(stop_token_ids)
        max_tokens = (as_ints([max_tokens]) or [max_tokens])[0]
        check_request(prompts, seeds, max_tokens, temperature, stop)
        if versions is not None:
            versions = list(versions)
            if len(versions) != len(prompts):
                raise ValueError(f"versions: {len(versions)} for {len(prompts)} prompts")
        return {"prompts": prompts, "seeds": seeds, "max_tokens": max_tokens, "temperature": float(temperature),
                "stop_token_ids": stop, "versions": versions}

    def generate(self, prompts: list[list[int]], *, seeds: list[int] | None, max_tokens: int, temperature: float,
                 stop_token_ids: list[int] | None = None, versions: list | None = None) -> list[Sample]:
        """One request per entry (a GRPO group: the same prompt repeated with different seeds), results in order.
        seeds=None: unseeded sampling. temperature 0: greedy. Stops at max_tokens, at a stop id or at the model's
        EOS (both kept as the last response token). versions (pin engines): the held version each request is
        served with (None: the newest)."""
        body = self._body(prompts, seeds, max_tokens, temperature, stop_token_ids, versions)
        t0 = time.perf_counter()
        try:
            out = self._request("POST", "/generate", body)
        finally:
            self.generate_s += time.perf_counter() - t0
        return [decode_sample(p, s) for p, s in zip(body["prompts"], out["samples"])]

    def stream(self, prompts: list[list[int]], *, seeds: list[int] | None, max_tokens: int, temperature: float,
               stop_token_ids: list[int] | None = None, versions: list | None = None):
        """As generate, but yields (index, Sample) as each request finishes (other clients' requests and adapter
        pushes share the engine meanwhile). A failed request raises RuntimeError when its line comes; leaving the
        iteration early closes the connection, and the engine stops the remaining requests."""
        body = {**self._body(prompts, seeds, max_tokens, temperature, stop_token_ids, versions), "stream": True}
        t0 = time.perf_counter()
        try:
            with self._open("POST", "/generate", body) as r:
                try:
                    for raw in r:
                        line = json.loads(raw)
                        if "error" in line:
                            raise RuntimeError(f"rollout engine: request {line['index']} failed: {line['error']}")
                        yield line["index"], decode_sample(body["prompts"][line["index"]], line["sample"])
                except (ConnectionError, TimeoutError) as e:
                    self._no_answer("/generate", e)
        finally:
            self.generate_s += time.perf_counter() - t0

    def status(self) -> dict:
        """Served adapter version and mode, engine settings, busy seconds and uptime."""
        st = self._request("GET", "/status")
        return {**st, "busy_s": self.busy_s, "generate_s": self.generate_s, "push_s": self.push_s,
                "uptime_s": time.time() - self.started_at, "restarts": self.restarts}

    @property
    def busy_s(self) -> float:
        """Seconds spent in generate and in pushes since the engine object was made (all restarts)."""
        return self.generate_s + self.push_s

    def cpu_seconds(self) -> float:
        """utime + stime of the engine process so far (Linux /proc)."""
        self._check_alive()
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
