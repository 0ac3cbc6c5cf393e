"""Moved to checks/vllm_peft.py; this name stays until bench/serve_capture_worker.py imports it from there."""
from ..checks.vllm_peft import vllm_load_check, write_peft_dir  # noqa: F401
