"""What the engine server lets in (pure): the shared secret, the worker methods callable over /collective_rpc, and
the size of a request body.

    token = load_token(token_file, os.environ)          # None: no token (the server answers /health only)
    check_bind(host, token)                             # ValueError: a non-loopback address needs a token
    authorized(request_headers, token)                  # constant-time comparison of "Authorization: Bearer <t>"
    check_rpc(method)                                   # ValueError unless one of RPC_METHODS

The token is generated per run by the client (new_token), handed to the engine process by environment
(TOKEN_ENV) or by a file readable by its owner only, and sent by every client call but /health. A server started
without a token serves nothing but /health, loopback included: on a shared node every local user reaches loopback.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import secrets

TOKEN_ENV = "MOE_LORA_ENGINE_TOKEN"
HEADER = "Authorization"
DEFAULT_MAX_BODY = 512 << 20            # bytes; an HTTP push sends base64 buckets (64 MiB raw by default)
DRAIN_FACTOR = 4                        # an oversized body up to this many times the limit is read (and dropped)
                                        # before its 413, so that a client still sending gets the reply

# the worker-extension methods our transports and the engine client call (vllm/worker_ext.py)
RPC_METHODS = frozenset({
    "moe_lora_begin", "moe_lora_bucket", "moe_lora_bucket_blob", "moe_lora_bucket_shm", "moe_lora_bucket_ipc",
    "moe_lora_commit", "moe_lora_abort", "moe_lora_push", "moe_lora_push_blob", "moe_lora_push_shm",
    "moe_lora_status", "moe_lora_clear", "moe_lora_set_mode",
    # the base weights (vllm/base_sync.py): our backend, then vLLM's own weight-transfer calls
    "moe_lora_base_init", "moe_lora_base_abort", "moe_lora_base_status",
    # a peer's base: the live engine's export of the base it keeps
    "moe_lora_base_export_begin", "moe_lora_base_export_bucket", "moe_lora_base_export_end",
    "start_weight_update", "update_weights", "finish_weight_update",
    "init_weight_transfer_engine", "shutdown_weight_transfer_engine",     # a gloo group for a broadcast
})


def new_token() -> str:
    return secrets.token_urlsafe(32)


def load_token(token_file: str | None, environ) -> str | None:
    """The token from token_file (stripped) or else environ[TOKEN_ENV]; None if neither is set. ValueError for an
    empty token or a file others can read."""
    if token_file:
        mode = os.stat(token_file).st_mode
        if mode & 0o077:
            raise ValueError(f"--token-file {token_file}: readable by others (mode {oct(mode & 0o777)}); "
                             f"chmod 600 it")
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"--token-file {token_file} is empty")
        return token
    token = environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise ValueError(f"{TOKEN_ENV} is set but empty")
    return token.strip() if token else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise ValueError(f"--host {host} is not a loopback address: the engine needs a token (--token-file or "
                         f"{TOKEN_ENV}), or anyone who reaches the port could push adapters")


def authorized(headers, token: str | None) -> bool:
    """headers: a mapping with .get (http.server's message). No token configured: nothing is authorized (the server
    answers /health only)."""
    if token is None:
        return False
    got = headers.get(HEADER) or ""
    want = f"Bearer {token}"
    return hmac.compare_digest(got.encode(), want.encode())


def auth_header(token: str | None) -> dict:
    return {HEADER: f"Bearer {token}"} if token else {}


def check_rpc(method) -> str:
    if not isinstance(method, str) or method not in RPC_METHODS:
        raise ValueError(f"method {method!r:.80} is not callable over /collective_rpc (allowed: the moe_lora_* "
                         f"methods of the adapter transports)")
    return method


NO_TOKEN = (f"this engine was started without a token (--token-file or {TOKEN_ENV}): it serves /health only")
