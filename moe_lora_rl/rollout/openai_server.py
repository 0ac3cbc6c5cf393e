"""vLLM's own OpenAI server as a separate process with our worker extension, bound to loopback, with vLLM's dev
endpoints on: transfer's HttpTransport pushes adapters to its /collective_rpc. start_server() waits until it is
healthy; ServerHandle.stop() ends it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..vllm import WORKER_EXTENSION
from ..vllm.compat import check_vllm_version


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(model: str, port: int, *, dtype: str = "float32", log_dir: str | Path = ".",
                 timeout: float = 300.0, extra: list[str] | None = None) -> ServerHandle:
    check_vllm_version("start_server")                 # before the server process loads the model
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log = Path(log_dir) / f"vllm-server-{port}.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", "512", "--enforce-eager",
           "--no-enable-prefix-caching", "--served-model-name", "policy", "--worker-extension-cls", WORKER_EXTENSION,
           *_checkpoint_args(model), *(extra or [])]
    # cwd: a folder without a package named like ours, so the plugin is not shadowed
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=Path(log_dir))
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; log: {log}\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    _rpc(url, "moe_lora_prepare")     # the fixes on the loaded model before any request
                    return ServerHandle(proc, url, log)
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"vLLM server not healthy after {timeout:.0f} s; log: {log}")


def _checkpoint_args(model: str) -> list[str]:
    """The server flags of what the checkpoint needs (rollout/engine.checkpoint_settings; MLA only)."""
    import json

    from .vllm_engine import checkpoint_settings

    kw = checkpoint_settings(model, {})
    args = ["--hf-overrides", json.dumps(kw["hf_overrides"])] if kw.get("hf_overrides") else []
    return args + (["--attention-backend", kw["attention_backend"]] if kw.get("attention_backend") else [])


def _rpc(url: str, method: str) -> None:
    import json

    req = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": method}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def prompt_logprobs_http(url: str, seqs: list[list[int]]) -> list[list[float]]:
    """Per-token logprobs of token sequences through /v1/completions (prompt_logprobs)."""
    import json

    out = []
    for s in seqs:
        body = json.dumps({"model": "policy", "prompt": s, "max_tokens": 1, "prompt_logprobs": 0,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        plp = choice["prompt_logprobs"]
        out.append([plp[t][str(s[t])]["logprob"] for t in range(1, len(s))])
    return out
