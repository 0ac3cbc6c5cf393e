"""How the Megatron side runs on this host: device, dtype, process-group backend, layer spec, CPU initialisation.

Chosen once by the caller and passed down:

    rc = RunConfig(device="cuda", dtype="bf16", layer_spec="te")      # ValueError on an unknown value or combination
    rc.check_host()                    # ValueError when the machine lacks the device / backend / Transformer Engine
    host = prepare_host(rc)            # CPU runs only: megatron-core's CPU support (cpu_support.apply()), once
    init_distributed(layout, rc); model = build_model(arch, layout, rc); forward_logits(model, ...)

The kwargs builders below are pure (no torch.cuda, no process group): what a config asks of megatron-core can be
checked on any machine.
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIXED = "cpu:gloo,cuda:nccl"
BACKENDS = ("gloo", MIXED)
LAYER_SPECS = ("local", "te")
PG_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class RunConfig:
    device: str = "cpu"
    """cpu (gloo, megatron-core's CPU support applied by the caller) or cuda."""
    dtype: str = "fp32"
    """Base-model parameters and activations: fp32 or bf16. Routing runs in fp32 either way (moe_router_dtype)."""
    backend: str | None = None
    """Process-group backend: gloo on cpu; on cuda cpu:gloo,cuda:nccl (NCCL for megatron-core's collectives on CUDA
    tensors, gloo for the CPU tensors the training core reduces: logprob rows, loss statistics, route counts)."""
    layer_spec: str = "local"
    """local: megatron's plain-torch modules (SequentialMLP experts); te: Transformer Engine (TEGroupedMLP), GPU."""
    cpu_init: bool | None = None
    """Create parameters on the CPU first (use_cpu_initialization); default on for cpu, off for cuda."""
    grads_fp32: bool = True
    """Full-weight training in bf16 keeps fp32 main grads and reduces them in fp32 (DDP grad_reduce_in_fp32)."""
    adapter_dtype: str = "fp32"
    """LoRA adapter parameters (LoRAConfig.dtype is set from this by the caller); fp32 whatever the base dtype."""
    grouped_experts: bool = False
    """layer_spec local: the legacy GroupedMLP (one weight per projection for all local experts, grouped GEMM,
    megatron-core 0.16 only) instead of SequentialMLP's expert-by-expert loop (megatron.build.build_model)."""

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: choose one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {tuple(DTYPES)}")
        if self.adapter_dtype not in DTYPES:
            raise ValueError(f"adapter_dtype={self.adapter_dtype!r}: choose one of {tuple(DTYPES)}")
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"layer_spec={self.layer_spec!r}: choose one of {LAYER_SPECS}")
        if self.backend is None:
            object.__setattr__(self, "backend", "gloo" if self.device == "cpu" else MIXED)
        if self.backend == "nccl":
            raise ValueError(f"backend='nccl': a group with NCCL alone has no backend for the CPU tensors the "
                             f"training core reduces (logprob rows, loss statistics, route counts); use "
                             f"backend={MIXED!r} (the default on cuda)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: choose one of {BACKENDS}")
        if self.cpu_init is None:
            object.__setattr__(self, "cpu_init", self.device == "cpu")
        if self.device == "cpu" and self.backend == MIXED:
            raise ValueError(f"backend={MIXED!r} needs device='cuda'; use backend='gloo'")
        if self.device == "cuda" and self.backend == "gloo":
            raise ValueError("backend='gloo' with device='cuda': megatron-core's collectives on CUDA tensors need "
                             f"backend={MIXED!r}")
        if self.device == "cpu" and not self.cpu_init:
            raise ValueError("cpu_init=False with device='cpu': megatron-core then allocates parameters on "
                             "torch.cuda.current_device(); keep cpu_init=True")
        if self.layer_spec == "te" and self.device != "cuda":
            raise ValueError(f"layer_spec='te' with device={self.device!r}: Transformer Engine runs on CUDA only; "
                             "use layer_spec='local'")

        if self.grouped_experts and self.layer_spec == "te":
            raise ValueError("grouped_experts=True with layer_spec='te': the TE spec has its own grouped experts "
                             "(TEGroupedMLP)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown RunConfig fields {sorted(unknown)}")
        return cls(**d)

    def check_host(self) -> None:
        """What this machine must have for the config; ValueError naming the value, before any process group."""
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': this machine has no CUDA device (torch.cuda.is_available() is False); "
                             "use device='cpu'")
        if self.device == "cpu" and torch.cuda.is_available():
            raise ValueError("device='cpu' on a machine with a CUDA device: megatron-core's CPU support replaces "
                             "torch.cuda functions process-wide; use device='cuda'")
        if self.backend == MIXED:
            import torch.distributed as dist

            if not (torch.cuda.is_available() and dist.is_nccl_available()):
                raise ValueError(f"backend={MIXED!r}: NCCL is not available on this machine (no CUDA); use "
                                 "backend='gloo' with device='cpu'")
        if self.layer_spec == "te":
            import importlib.util

            if importlib.util.find_spec("transformer_engine") is None:
                raise ValueError("layer_spec='te': transformer_engine is not installed; use layer_spec='local'")


def host_shims(rc: RunConfig) -> tuple[str, ...]:
    """The process-wide shims a config needs (pure): megatron-core's CPU support for CPU runs; on CUDA with the local
    spec (which runs without Transformer Engine) megatron-core 0.16's router fix (te_gemm_fix, a no-op where TE is
    installed or the version has the fix); nothing on CUDA with TE."""
    if rc.device == "cpu":
        return ("cpu_support",)
    return ("te_gemm_fix",) if rc.layer_spec == "local" else ()


def prepare_host(rc: RunConfig):
    """The caller's one-time host setup: check the machine, then apply the shims host_shims() names. Returns the
    applied shim's handle (restore() undoes it) or None."""
    rc.check_host()
    shims = host_shims(rc)
    if "cpu_support" in shims:
        from . import cpu_support

        return cpu_support.apply()
    if "te_gemm_fix" in shims:
        from . import te_gemm_fix

        return te_gemm_fix.apply()
    return None


def transformer_kwargs(rc: RunConfig) -> dict:
    """The TransformerConfig fields that depend on the run config (the model-derived ones are in build.py)."""
    dt = rc.torch_dtype
    te = rc.layer_spec == "te"
    return dict(
        params_dtype=dt, pipeline_dtype=dt, bf16=rc.dtype == "bf16", fp16=False,
        use_cpu_initialization=rc.cpu_init, perform_initialization=False,   # weights come from the HF checkpoint
        moe_router_dtype="fp32",
        # TE's grouped GEMM (TEGroupedMLP) on CUDA; the local spec runs SequentialMLP
        moe_grouped_gemm=te,
        # gradient_accumulation_fusion writes into DDP's fp32 main_grad buffers: only where the model is wrapped in
        # megatron's DDP (full-weight training on GPU), not for frozen bases with adapters
        gradient_accumulation_fusion=False,
    )


def spec_kwargs(rc: RunConfig) -> dict:
    """Arguments of get_gpt_decoder_block_spec (besides the TransformerConfig)."""
    return {"use_transformer_engine": rc.layer_spec == "te", "normalization": "RMSNorm"}


def process_group_kwargs(rc: RunConfig) -> dict:
    """torch.distributed.init_process_group arguments (rank/world from torchrun's environment)."""
    return {"backend": rc.backend, "timeout": PG_TIMEOUT}


def parallel_state_kwargs(rc: RunConfig) -> dict:
    """parallel_state.initialize_model_parallel arguments besides the layout sizes."""
    # gloo copies of every group only serve CPU-side collectives of the distributed checkpointer; on CPU the main
    # groups are gloo already
    return {"create_gloo_process_groups": False}


def ddp_kwargs(rc: RunConfig) -> dict:
    """DistributedDataParallelConfig for full-weight training: fp32 main grads, reduced in fp32."""
    return {"grad_reduce_in_fp32": rc.grads_fp32, "overlap_grad_reduce": False, "use_distributed_optimizer": False,
            "check_for_nan_in_grad": True}
