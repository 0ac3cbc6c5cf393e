"""Run in its own process: our engine's weight stream (get_per_tensor_param, checkpoint-engine mode) through our
checkpoint-engine backend into an in-process vLLM engine with our worker extension; vLLM's prompt log-probs then
equal Megatron+LoRA's. Prints one line "RESULT <json>".

    engine.get_per_tensor_param()  x2     first: header + base + adapters, then header + adapters only
    MoELoRACheckpointEngine.send_weights  -> moe_lora_begin / bucket / commit in the extension
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

os.environ.setdefault("VERL_PLATFORM", "moe_lora_cpu")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cpu")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    a = ap.parse_args(argv)
    import torch

    from ...bench.refit_vllm_worker import make_llm, prompt_logprobs
    from ...bench.vllm_env import set_engine_env
    from ...megatron.forward import forward_logits
    from ...refit.transports import InprocTransport
    from .check_worker import LORA, randomize
    from .checkpoint_engine import MoELoRACheckpointEngine
    from .config import MoELoRAEngineConfig
    from .engine import MoELoRAEngine
    from .weight_sync import META, decode_meta, encode_meta
    from verl.workers.config import HFModelConfig

    set_engine_env()
    eng = MoELoRAEngine(HFModelConfig(path=a.model, lora=dict(LORA)),
                        MoELoRAEngineConfig(dtype="float32", device="cpu", forward_only=True))
    eng.initialize()
    randomize(eng.model, seed=3)
    eng.version = 1
    first = list(eng.get_per_tensor_param()[0])
    second, peft = eng.get_per_tensor_param()
    second = list(second)
    colocated_gen, colocated_peft = eng.get_per_tensor_param(layered_summon=False, base_sync_done=True)
    colocated = list(colocated_gen)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, eng.arch.vocab_size, (4, 16), generator=g)
    logits = forward_logits(eng.model, seqs, eng.arch.vocab_size)
    want = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, seqs[:, 1:, None])[..., 0]
    with eng.disable_adapter():
        base_want = torch.log_softmax(forward_logits(eng.model, seqs, eng.arch.vocab_size).double(), -1)[
            :, :-1].gather(-1, seqs[:, 1:, None])[..., 0]

    llm = make_llm(a.model)
    ck = MoELoRACheckpointEngine(bucket_size=1 << 16)
    ck.transports = [InprocTransport(llm)]
    base_got = prompt_logprobs(llm, seqs.tolist())
    asyncio.run(ck.send_weights(iter(second)))
    got = prompt_logprobs(llm, seqs.tolist())
    # a stream with a corrupted adapter is refused (checksum) and the served version stays
    bad = [(n, t + 1.0 if i == 2 else t) for i, (n, t) in enumerate(second)]
    bad[0] = (META, encode_meta(dict(decode_meta(second[0][1]), version=2)))   # a new version, wrong bytes
    try:
        asyncio.run(ck.send_weights(iter(bad)))
        refused = ""
    except Exception as e:  # noqa: BLE001
        refused = str(e).splitlines()[0]
    after_bad = prompt_logprobs(llm, seqs.tolist())
    res = {
        "first_meta": decode_meta(first[0][1]), "second_meta": decode_meta(second[0][1]),
        "first_names": len(first) - 1, "first_lora_names": sum(".lora_" in n for n, _ in first),
        "second_names": len(second) - 1, "second_lora_names": sum(".lora_" in n for n, _ in second),
        "peft_config_checkpoint_mode": peft, "colocated_peft_r": colocated_peft["r"],
        "colocated_names": len(colocated) - 1,
        "refit_logprob_diff": float((got - want).abs().max()), "base_vs_lora": float((base_want - want).abs().max()),
        "engine_base_vs_megatron_base": float((base_got - base_want).abs().max()),
        "buckets": ck.last["buckets"], "served": str(ck.last["served"])[:200],
        "bad_refused": refused, "after_bad_diff": float((after_bad - want).abs().max()),
    }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
