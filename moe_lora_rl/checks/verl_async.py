"""Run in its own process, after a run of one of verl's async trainers with our override (recipes/verl_moe_lora/
run_cpu_async.sh): did every adapter version the trainer sent reach the engine? Prints "RESULT <json>".

    sync.jsonl     trainer lines (version sent) and server lines (version served after the sync, probe log-probs)
    ckpt/global_step_N/actor/step-N   our engine's checkpoints (every step): the reference of each version

versions_synced: the fraction of syncs after which the server serves the version the trainer sent last (and with
its checksum). probe_max_diff: max |server probe log-prob - our Megatron engine's log-prob on the same version|,
over the versions with a checkpoint (version 0: the initial adapters, B = 0, i.e. the base model); each version's
log-probs are recomputed by loading its checkpoint into a fresh engine. probe_diff_vs_other_version: the same
served log-probs against the neighbouring version's reference (the negative control: what a stale adapter gives).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def pair_syncs(lines: list[dict]) -> list[dict]:
    """Each server line with the trainer's latest version sent before it (pure; lines in file order)."""
    sent, out = None, []
    for l in lines:
        if l.get("side") == "trainer":
            sent = l
        elif l.get("side") == "server":
            out.append({"sent": None if sent is None else sent["version"],
                        "sent_checksum": None if sent is None else sent["checksum"],
                        "served": l.get("version"), "served_checksum": l.get("checksum"),
                        "probe": l.get("probe_logprobs"), "replica": l.get("replica")})
    return out


def synced_fraction(pairs: list[dict]) -> float:
    """Syncs (server lines after a trainer line) whose served version and checksum are the ones sent."""
    judged = [p for p in pairs if p["sent"] is not None]
    if not judged:
        raise ValueError("sync log: no server line follows a trainer line (no adapter version was delivered)")
    ok = [p["served"] == p["sent"] and p["served_checksum"] == p["sent_checksum"] for p in judged]
    return sum(ok) / len(ok)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="the run's OUT_DIR")
    ap.add_argument("--model", required=True)
    ap.add_argument("--probe", required=True, help="the probe token ids, comma separated")
    a = ap.parse_args(argv)
    from .verl_worker import VERL_CPU_ENV

    for k, v in VERL_CPU_ENV.items():
        os.environ.setdefault(k, v)
    import torch

    from ..integration.verl import plugin  # noqa: F401
    from ..integration.verl.verl_config import MoELoRAEngineConfig
    from ..integration.verl.engine import MoELoRAEngine
    from ..rollout.vllm_engine import set_engine_env
    from .verl_refit import megatron_lp
    from verl.workers.config import HFModelConfig

    set_engine_env()
    run = Path(a.run)
    lines = [json.loads(l) for l in (run / "sync.jsonl").read_text().splitlines() if l.strip()]
    pairs = pair_syncs(lines)
    probe = torch.tensor([[int(t) for t in a.probe.split(",")]])
    ckpts = sorted(run.glob("ckpt/global_step_*/actor"))
    if not ckpts:
        raise ValueError(f"{run}/ckpt: no checkpoints (the run needs trainer.save_freq=1)")
    lora = json.loads(next(ckpts[0].glob("step-*/lora_config.json")).read_text())     # the run's LoRA config
    eng = MoELoRAEngine(HFModelConfig(path=a.model, lora={k: lora[k] for k in ("rank", "alpha", "targets",
                                                                                "adapter_layout", "init_seed")}),
                        MoELoRAEngineConfig(dtype="float32", device="cpu", forward_only=True))
    eng.initialize()
    refs = {0: megatron_lp(eng, probe)[0]}
    for d in ckpts:
        eng.load_checkpoint(str(d))                     # refused unless model and LoRA config are the run's
        refs[int(eng.version)] = megatron_lp(eng, probe)[0]
    diffs, stale = {}, {}
    for p in pairs:
        v = p["served"]
        if p["probe"] is None or v not in refs:
            continue
        got = torch.tensor(p["probe"], dtype=refs[v].dtype)
        diffs[v] = max(diffs.get(v, 0.0), float((got - refs[v]).abs().max()))
        other = v + 1 if v + 1 in refs else v - 1
        if other in refs:
            stale[v] = float((got - refs[other]).abs().max())
    res = {"syncs": len(pairs), "versions_synced": synced_fraction(pairs),
           "versions_served": sorted({p["served"] for p in pairs if p["served"] is not None}),
           "versions_with_reference": sorted(refs), "probe_max_diff": max(diffs.values()) if diffs else None,
           "probe_diff_per_version": diffs, "probe_diff_vs_other_version": min(stale.values()) if stale else None}
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
