"""vLLM 0.32's CPU worker with the Qwen3.5 vision-import fix (vllm/vision_import_fix.py) around its model load, for
engines whose workers run in processes of their own (verl's rollout server: vLLM's multiprocess executor, spawned
from a Ray actor), where the scoped fix in the process that builds the engine does not reach.

    engine argument  worker_cls=WORKER_CLS        (vision_import_fix.engine_args gives it when the fix is needed)

The fix is entered in the worker only for the block that loads the model class (load_model), and there only when
vision_import_fix.needed(model, cpu=True); vLLM mixes our worker extension into this class as into its own.
make_engine's engines run their worker in the engine's process and need none of this.
"""
from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from . import vision_import_fix


class VisionFixCPUWorker(CPUWorker):
    def load_model(self, *args, **kwargs) -> None:
        with vision_import_fix.scoped(self.model_config.model, cpu=True):
            super().load_model(*args, **kwargs)
