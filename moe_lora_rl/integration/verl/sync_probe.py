"""What a rollout server serves after each weight sync, for the check that every adapter version reaches the engine
(verl's async trainers): our replica appends one line per sync to rollout.checkpoint_engine.engine_kwargs.moe_lora
.sync_log, beside the trainer's line for the version it sent (checkpoint_engine.log_sync):

    {"side": "server", "replica", "version", "checksum", "probe_logprobs"}

probe_logprobs: the engine's log-probs of engine_kwargs.moe_lora.probe_tokens (a fixed token sequence; entry t is
log p(token t+1)), to compare with our Megatron engine's on the same adapter version (checks/verl_async.py).
"""
from __future__ import annotations

import uuid


def sync_settings(rollout_config) -> tuple[str | None, list[int] | None]:
    kw = (rollout_config.checkpoint_engine.engine_kwargs or {}).get("moe_lora", {}) or {}
    probe = kw.get("probe_tokens")
    return kw.get("sync_log"), ([int(t) for t in probe] if probe else None)


async def probe_logprobs(engine, tokens: list[int]) -> tuple[list[float], str]:
    """The served model's log-probs of a token sequence (prompt log-probs of a one-token greedy request), and the
    request id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rid = f"moe_lora_probe_{uuid.uuid4().hex}"
    final = None
    async for out in engine.generate(prompt=TokensPrompt(prompt_token_ids=list(tokens)),
                                     sampling_params=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                     request_id=rid):
        final = out
    if final is None or final.prompt_logprobs is None:
        raise RuntimeError("sync probe: the engine returned no prompt log-probs")
    return [float(final.prompt_logprobs[t][tokens[t]].logprob) for t in range(1, len(tokens))], rid


async def record_served(server) -> dict:
    """After a sync: the served version and checksum (the worker extension's status) and the probe's log-probs."""
    from .checkpoint_engine import log_sync

    path, probe = sync_settings(server.config)
    status = (await server.engine.collective_rpc("moe_lora_status"))[0]
    line = {"side": "server", "replica": server.replica_rank, "version": status.get("version"),
            "checksum": status.get("checksum")}
    if probe:
        line["probe_logprobs"], rid = await probe_logprobs(server.engine, probe)
        if getattr(server, "moe_routes", None) is not None and server.moe_routes.meta is not None:
            await server.moe_routes.discard(server.engine, rid)
        after = (await server.engine.collective_rpc("moe_lora_status"))[0]
        if after.get("version") != line["version"]:     # a sync committed during the probe: it proves nothing
            line["probe_logprobs"] = None
    log_sync(path, line)
    return line
