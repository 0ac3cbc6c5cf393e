"""A CPU platform for verl (gloo, no accelerator), registered as "moe_lora_cpu" (by plugin.py) and used only when selected with
VERL_PLATFORM=moe_lora_cpu (pair it with VERL_ENGINE_DEVICE=cpu): its availability probe answers False, so verl's
auto-detection never picks it. verl then makes tensors on "cpu", creates "cpu:gloo" groups, and its memory metrics
read 0."""
from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase

NAME = "moe_lora_cpu"


def _zero(*_a, **_k) -> int:
    return 0


def _nothing(*_a, **_k) -> None:
    return None


# what verl calls on get_torch_device(): memory statistics and cache control (nothing to do on the CPU)
CPU_DEVICE = types.SimpleNamespace(
    is_available=lambda: True, current_device=_zero, device_count=lambda: 1, set_device=_nothing,
    synchronize=_nothing, empty_cache=_nothing, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    max_memory_allocated=_zero, max_memory_reserved=_zero, memory_allocated=_zero, memory_reserved=_zero,
    reset_peak_memory_stats=_nothing, mem_get_info=lambda *_a: (0, 0), get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state, ipc_collect=_nothing,
    get_device_name=lambda *_a: "CPU")      # verl's flops counter: the name it uses for torch.cpu itself


class CPUPlatform(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False                       # never auto-detected: selected by VERL_PLATFORM only

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    # verl places one worker per Ray "device" slot and reads the slot's id back from
    # get_accelerator_ids()[ray_resource_name()] (the vLLM replica's launch_servers), a map that only holds
    # accelerator resources, never "CPU". So the slots are Ray's logical "GPU" resource, declared without any GPU
    # by ray_init.num_gpus=<workers per node> (a Ray count, no CUDA involved).
    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {"num_gpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
