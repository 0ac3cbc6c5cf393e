"""The two processes of the GPU check (tests/kit/gpu_check.py) besides its parent:

    python -m kit.gpu_check_worker --device cuda --dtype bf16 --out F    one R3 + LoRA case, saved to F
    python -m kit.gpu_check_worker --device cpu --dtype fp32 --out F     the same case: the reference
    serve(conn)     the engine end of a CUDA IPC handoff (a spawned process): FakeEngine's staged push with the
                    worker extension's own moe_lora_bucket_ipc body, answering (method, args) over a Pipe

The case (replay_case) is one rank (world size 1, tp1ep1pp1) of the training core both drivers call
(policy/training.py): the default tiny model with per-expert LoRA (adapters set to known nonzero values), forward
passes replaying forced routes (the batch's and the same routes shuffled over positions), then one AdamW step on a
simple advantage-weighted logprob loss replaying the routes, and the same step replaying the shuffled routes
(parameters and optimizer state restored between). Each case runs in a process of its own: megatron-core's CPU
support patches torch.cuda process-wide, so the CPU reference runs with CUDA hidden (CUDA_VISIBLE_DEVICES="").
"""
from __future__ import annotations

import argparse

import torch

from .fakes import FakeEngine

LR = 1e-3
LAYOUT = "tp1ep1pp1"


def _init(rc) -> None:
    """Process group (world size 1, in-memory store; RunConfig's own backend: gloo on the CPU, cpu:gloo,cuda:nccl
    on CUDA) and megatron-core's parallel state for tp1ep1pp1."""
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.megatron.parallel import init_distributed

    init_distributed(Layout.parse(LAYOUT), rc)


def replay_case(rc) -> dict:
    """The case described in the module docstring; every tensor returned on the CPU in fp32 (routes replayed, so
    the same computation on any device)."""
    from moe_lora_rl.checks.adapters import randomize_adapters
    from moe_lora_rl.lora import LoRAConfig, gather_adapters
    from moe_lora_rl.megatron.forward import gather_vocab
    from moe_lora_rl.megatron.layout import Layout
    from moe_lora_rl.megatron.parallel import teardown
    from moe_lora_rl.models import get_model
    from moe_lora_rl.policy.logprobs import label_logprobs
    from moe_lora_rl.policy.training import TrainingCore
    from .policy_update_worker import make_batch

    _init(rc)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("all",), adapter_layout="per_expert", dtype="float32")
    core = TrainingCore(str(get_model("glm4_moe", "tiny")), Layout.parse(LAYOUT), rc, lora,
                        adamw=dict(lr=LR, weight_decay=0.0))
    randomize_adapters(core.model, seed=7, b_scale=0.05)
    arch = core.arch
    batch, shuffled = make_batch(arch.vocab_size, tuple(arch.moe_layer_ids), arch.num_experts, arch.topk)
    n, s, v = batch.num_rows, batch.seq_len, arch.vocab_size
    rows = [list(range(n))]
    mbs = [{"tokens": batch.tokens, "ids": rows[0]}]
    kw = dict(seq_length=s, micro_batch_size=n, rows=rows, lengths=batch.lengths)
    mask, adv, label_mask = batch.loss_mask, batch.advantages, batch.label_mask()
    n_tok = float(mask.sum())

    def forward(routes):
        core.model.eval()
        res = core.run(mbs, forward_only=True, replay="replay", routes=routes, measure=True, **kw,
                       on_output=lambda t, mb: (gather_vocab(t, v).float().cpu(),
                                                label_logprobs(t, mb["tokens"], v)[:, :s - 1].float().cpu()))
        logits, lp = res.outputs[0]
        return logits, lp * label_mask, res.token_disagreement


    def loss_fn(t, batch):               # run_schedule's loss contract (loss, num_tokens, logged), as Policy.update
        dev = t.device
        lp = label_logprobs(t, batch["tokens"], v)[:, :s - 1]
        loss = -(adv.to(dev) * lp * mask.to(dev)).sum() / n_tok
        return loss, torch.tensor(1, dtype=torch.int, device=dev), {"loss": loss.detach().float().cpu()}

    def update(routes) -> dict:
        core.zero_grad()
        core.model.train()
        res = core.run(mbs, forward_only=False, on_output=loss_fn, replay="replay", routes=routes, **kw)
        step = core.step(1.0)
        return {"loss": float(res.outputs[0]["loss"]), "grad_norm": step.grad_norm, "skipped": step.skipped,
                "grads": gather_adapters(core.model, grads=True), "adapters": gather_adapters(core.model)}

    out = {"device": rc.device, "dtype": rc.dtype, "backend": rc.backend, "lr": LR}
    out["logits"], out["logprobs"], out["token_disagreement"] = forward(batch.routes)
    out["shuffled_logits"], out["shuffled_logprobs"], _ = forward(shuffled)
    before = gather_adapters(core.model)
    saved = [p.detach().clone() for p in core.params]
    out["shuffled_update"] = update(shuffled)              # the control's step, then parameters and moments back
    with torch.no_grad():
        for p, x in zip(core.params, saved):
            p.copy_(x)
    core.optimizer.state.clear()
    out["before"], out["update"] = before, update(batch.routes)
    core.replayer.detach()
    del core
    teardown()
    return _to_cpu(out)


def _to_cpu(obj):
    """Every tensor in nested dicts on the CPU (the parent compares them with the CPU case's)."""
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj.detach().cpu() if isinstance(obj, torch.Tensor) else obj


class IpcEngine(FakeEngine):
    """The engine end of the handoff: FakeEngine's staged push (vllm/staged_push.py: begin, buckets, digest checked at
    commit) plus the worker extension's moe_lora_bucket_ipc itself (handles rebuilt on this device, copied, checked
    against the bucket's CRC), without its vLLM version check; `received` returns what the commit staged, on the
    CPU, for the byte comparison."""

    def _rpc_bucket_ipc(self, version, index, info, crc):
        from moe_lora_rl.vllm.worker_ext import MoELoRAWorkerExtension

        return MoELoRAWorkerExtension.moe_lora_bucket_ipc.__wrapped__(self, version, index, info, crc)

    def moe_lora_bucket(self, version, index, tensors):
        return self.st.bucket(version, index, tensors)

    _rpc_bucket = moe_lora_bucket          # InprocTransport's plain bucket: the pipe and staging checked without CUDA

    def _rpc_received(self):
        return {k: t.detach().cpu() for k, t in self.received.items()}


def serve(conn, device: int | None = 0) -> None:
    """Answer ("ok", result) or ("err", exception type, message) to each (method, args) until ("stop", ()).
    device: the CUDA device to open IPC handles on (None: no CUDA, plain buckets only)."""
    if device is not None:
        torch.cuda.set_device(device)
    engine = IpcEngine()
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", engine.call(method, *args)))
        except Exception as e:  # noqa: BLE001 - the sender re-raises it (a ValueError stays a ValueError)
            conn.send(("err", type(e).__name__, str(e)))


def main(argv=None) -> None:
    from moe_lora_rl.megatron.run_config import RunConfig, prepare_host

    ap = argparse.ArgumentParser(description="one replay + LoRA step case of the GPU check")
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rc = RunConfig(device=a.device, dtype=a.dtype)
    prepare_host(rc)
    torch.save(replay_case(rc), a.out)


if __name__ == "__main__":
    main()
