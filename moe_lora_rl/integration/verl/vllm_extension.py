"""Our vLLM worker extension inside verl: the staged-commit extension plus verl's colocated entry point.

    update_weights_from_ipc(peft_config, base_sync_done, use_shm)    what verl's ServerAdapter.update_weights calls
        verl's BucketedWeightReceiver on verl's ZMQ handle (CUDA IPC, or shared memory where IPC is missing, as on
        the CPU) -> colocated.ColocatedSync: base weights loaded into the model (the first sync; a rollout started
        with load_format=dummy gets its real base here), adapters staged as one version and committed (checksum
        checked, previous version served until then)
    monkey_patch_model(vocab_size, banned_token_ids)    what verl's launch_server calls once the engine is up: verl's
        own sampling mask (`monkey_patch_compute_logits`: out-of-vocabulary tail and vision placeholders never
        sampled), as verl's extension does; not verl's MoE weight-loader patch (for older vLLM): our base load is
        vLLM's own layerwise reload

A bad stream does not leave verl's sender waiting: the receiver drains every bucket and the error is raised after
the last one, with the served version untouched: a base that fails to load half-way is rolled back (the model's
values and modules as before the first base bucket, vLLM's layerwise state reset; vllm/reload_txn.py).
"""
from __future__ import annotations

import logging
import traceback

import torch
from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload, initialize_layerwise_reload
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits, vLLMColocateWorkerExtension

from ...vllm.reload_txn import Transaction, check_loadable
from ...vllm.entry import entry
from ...vllm.worker_ext import MoELoRAWorkerExtension
from .colocated import ColocatedSync
from .plugin import register

logger = logging.getLogger(__name__)
register()               # verl's registries in the vLLM worker process (the CPU platform when VERL_PLATFORM names it)


class VerlMoELoRAWorkerExtension(MoELoRAWorkerExtension):
    # verl's handle formula (job id, replica, node-local rank), so the sender in the trainer finds this receiver
    _get_zmq_handle = vLLMColocateWorkerExtension._get_zmq_handle

    @entry
    def monkey_patch_model(self, vocab_size: int, banned_token_ids: list[int] | None = None) -> None:
        monkey_patch_compute_logits(self.model_runner.model, vocab_size, banned_token_ids)

    @entry
    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> dict:
        """peft_config is not read: the stream's header carries rank, alpha, version and checksum."""
        sync = ColocatedSync(base_sync_done)
        device = getattr(self, "device", None) or torch.device("cpu")
        errors: list[BaseException] = []
        reloading: list = []                             # the base's Transaction (vllm/reload_txn.py) once started
        shapes: list = []                                # (name, shape, dtype) of every base tensor received
        model = self.model_runner.model

        def on_bucket(weights, is_last):
            if errors:
                return                                   # drain the rest: verl's sender waits for every ack
            try:
                base = sync.bucket(weights, is_last)
                if base:
                    served = self._moe_lora_runtime().status()["version"]
                    if served is not None:
                        raise ValueError(f"base weights arrived while adapter version {served} is served: the base "
                                         "is synced once, before any adapter")
                    # on the CPU the receiver's tensors are views into the shared segment (its .to(cpu) copies
                    # nothing): load copies, so nothing outlives the segment
                    if not reloading:
                        reloading.append(Transaction(model))     # what to put back if the stream fails
                        initialize_layerwise_reload(model)       # vLLM's in-place reload (repacked CPU kernels)
                    shapes.extend((n, tuple(t.shape), t.dtype) for n, t in base)
                    model.load_weights([(n, t.clone() if t.device.type == "cpu" else t) for n, t in base])
            except Exception as e:  # noqa: BLE001
                # keep no traceback: its frames would hold views into the receiver's buffer past its cleanup
                logger.warning("weight sync refused: %s", "".join(traceback.format_exception(e)))
                errors.append(e.with_traceback(None))

        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=device, use_shm=use_shm).receive_weights(
            on_bucket_received=on_bucket)
        if reloading and not errors:
            try:
                # the whole stream, as meta stand-ins, dry-run before vLLM finalizes: a tensor the stream left out
                # would otherwise leave its layer on the old weights (vLLM only warns) or half-loaded
                check_loadable(model, [(n, torch.empty(sh, dtype=dt, device="meta")) for n, sh, dt in shapes],
                               "verl's base stream")
                finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
            except Exception as e:  # noqa: BLE001 - rolled back below, then raised
                errors.append(e)
        if reloading and errors:
            reloading[0].rollback()                      # the previous base serves, vLLM's reload state reset
        if errors:
            raise errors[0]
        m, served = sync.meta, self._moe_lora_runtime().status()
        if sync.plan(served) == "same":
            return {**served, "base_tensors": sync.base_count, "unchanged": True}
        out = self._moe_lora_one_shot(m["version"], m["checksum"], m["rank"], m["alpha"], lambda: sync.adapters)
        return {**out, "base_tensors": sync.base_count, "unchanged": False}
