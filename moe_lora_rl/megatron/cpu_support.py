"""CPU/gloo runtime support for megatron-core: the CUDA-only calls that break on a CPU machine, and their fixes.

Applied by an explicit call of the caller for CPU runs (run_config.prepare_host), never at import time and never
inside a forward:

    handle = cpu_support.apply()      # idempotent; returns the active handle
    ...
    handle.restore()                  # puts every patched symbol back

Every patch is listed in patches/README.md (symbol, versions, why, when to drop). The set is checked against the
installed megatron-core version: an untested version fails loudly instead of half-working.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

SUPPORTED_MCORE = ("0.16.", "0.19.")


def mcore_version() -> str:
    return importlib.metadata.version("megatron-core")


class _DummyStream:
    """Stands in for torch.cuda.Stream/Event on CPU: every wait/record is a no-op (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _DummyStream()

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _DummyStream)

    def __hash__(self):
        return 0


@contextlib.contextmanager
def _null_stream_ctx(stream=None):
    yield


@contextlib.contextmanager
def _rng_fork_noop(self, name=None):
    # CUDA RNG trackers isolate dropout/init randomness per TP rank; on CPU every dropout in our models is 0 and
    # initialisation is done on CPU (use_cpu_initialization), so the fork has nothing to isolate.
    yield


def _no_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    # megatron's activation checkpoint saves and restores the CUDA RNG state around the recompute; a CPU-only torch
    # has none (the CPU generator's state is saved and restored by the same code, torch.get/set_rng_state).
    return None


def _set_no_cuda_rng_state(new_state, device=-1, graph_safe=False):
    pass


def _checkpoint_without_output_init():
    # 0.16.1's CheckpointWithoutOutput.__init__ sets `self.fp8 = fp8 is not None`, so its default fp8=False (the
    # layernorm and expert-activation recompute) takes the Transformer Engine FP8 path, which raises NameError
    # without TE. None and False both mean "no FP8" here (MLA passes its quantization context or None).
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    original = CheckpointWithoutOutput.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = fp8 is not None and fp8 is not False

    return __init__


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    # Upstream only converts CUDA tensors; gloo's all_to_all_single rejects tensor split sizes, so CPU tensors must
    # become numpy/lists here too.
    if torch.is_tensor(tensor):
        tensor = tensor.detach().to("cpu")
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    """All-gather(-v) along dim 0. gloo's list all_gather rejects uneven tensors: pad, gather, trim."""
    world = group.size()
    if world == 1:
        return input_
    input_ = input_.contiguous()
    if output_split_sizes is None:
        out = torch.empty((input_.shape[0] * world, *input_.shape[1:]), dtype=input_.dtype)
        dist.all_gather_into_tensor(out, input_, group=group)
        return out
    sizes = [int(s) for s in output_split_sizes]
    longest = max(sizes) if sizes else 0
    padded = torch.zeros((longest, *input_.shape[1:]), dtype=input_.dtype)
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)


def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    """Reduce-scatter(-v) along dim 0; the uneven case is all_reduce + own slice (gloo has no reduce_scatter-v)."""
    world = group.size()
    if world == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is None:
        if input_.shape[0] % world:
            raise ValueError(f"reduce-scatter: dim 0 ({input_.shape[0]}) not divisible by group size {world}")
        out = torch.empty((input_.shape[0] // world, *input_.shape[1:]), dtype=input_.dtype)
        dist.reduce_scatter_tensor(out, input_, group=group)
        return out
    total = input_.clone()
    dist.all_reduce(total, group=group)
    sizes = [int(s) for s in input_split_sizes]
    start = sum(sizes[: group.rank()])
    return total[start : start + sizes[group.rank()]].contiguous()


def _grouped_mm_takes(a: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm's CPU kernel takes these operands: fp32/bf16, rows of whole 16-byte multiples."""
    return (hasattr(torch, "_grouped_mm") and a.device.type == "cpu" and a.dtype == w.dtype
            and a.dtype in (torch.float32, torch.bfloat16) and a.dim() == 2
            and all(n * a.element_size() % 16 == 0 for n in (a.shape[1], w.shape[2])))


def torch_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """Pure-torch grouped GEMM with grouped_gemm.ops.gmm's contract: rows of `a` split by batch_sizes, group i
    multiplied by b[i] (or b[i].T with trans_b). torch._grouped_mm where it takes the operands (one call over all
    groups, forward and backward bit-equal to the per-group matmuls: tests/unit/test_cpu_support.py), else a
    matmul per group; autograd from either."""
    sizes = [int(x) for x in (batch_sizes.tolist() if torch.is_tensor(batch_sizes) else batch_sizes)]
    if len(sizes) != b.shape[0]:
        raise ValueError(f"gmm: {len(sizes)} group sizes for {b.shape[0]} weight groups")
    w = b.transpose(1, 2) if trans_b else b
    if _grouped_mm_takes(a, w):
        out = torch._grouped_mm(a, w, offs=torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32))
        if out.requires_grad:               # its backward needs a strided gradient (not e.g. sum's expanded one)
            out.register_hook(lambda g: g.contiguous())
        return out
    outs = [torch.matmul(x, w.t() if trans_b else w) for x, w in zip(torch.split(a, sizes), b.unbind(0))]
    return torch.cat(outs, dim=0) if outs else a.new_zeros(0, b.shape[1] if trans_b else b.shape[2])


class _GmmOps:
    gmm = staticmethod(torch_gmm)


class _CudaDeviceToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites device='cuda' keyword arguments to CPU: the PP schedule and the default causal mask allocate on
    'cuda' explicitly (0.16.1 pipeline_parallel/schedules.py, transformer/utils.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@dataclass
class CpuSupport:
    """The applied patches; restore() undoes them in reverse order."""

    version: str
    patched: list[tuple[Any, str, Any]] = field(default_factory=list)

    def _set(self, owner: Any, name: str, value: Any, must_exist: bool = True) -> None:
        if must_exist and not hasattr(owner, name):
            raise RuntimeError(
                f"megatron-core {self.version}: {getattr(owner, '__name__', owner)}.{name} not found; "
                "the CPU support in moe_lora_rl/megatron/cpu_support.py must be revisited for this version"
            )
        self.patched.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    def restore(self) -> None:
        global _ACTIVE
        for owner, name, old in reversed(self.patched):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.patched.clear()
        _ACTIVE = None

    def cuda_device_kwargs_to_cpu(self):
        return cuda_device_kwargs_to_cpu()


@contextlib.contextmanager
def cuda_device_kwargs_to_cpu():
    """Scope for code that allocates with device='cuda' (PP schedules): rewrite those allocations to CPU."""
    with _CudaDeviceToCpu():
        yield


@contextlib.contextmanager
def model_code():
    """Inside cuda_device_kwargs_to_cpu's scope, the model's own forward runs without the rewrite: every torch call
    through a Python TorchFunctionMode costs a Python frame, a quarter of a CPU training step on a 128-expert model,
    and the model allocates on its inputs' device (torch.cuda.current_device() is already 'cpu'). Outside the scope:
    nothing."""
    if not isinstance(torch.overrides._get_current_function_mode(), _CudaDeviceToCpu):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


_MLA_CORE_ATTENTION = None


def mla_core_attention():
    """megatron's local DotProductAttention taking (and ignoring) the k_channels / v_channels that MLA passes (the
    local class does not accept them; its output width per head is config.kv_channels, set to v_head_dim, and
    MLA passes the softmax scale). Put into the local spec by build.py for MLA on CPU."""
    global _MLA_CORE_ATTENTION
    if _MLA_CORE_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)

        _MLA_CORE_ATTENTION = MLADotProductAttention
    return _MLA_CORE_ATTENTION


def duplicated_kv_down(attention) -> None:
    """Replace an MLA layer's linear_kv_down_proj (the local spec's ColumnParallelLinear) by a duplicated linear:
    the whole [kv_lora_rank + qk_rope_head_dim, hidden] weight on every TP rank, applied to the rank's own sequence
    shard, as the TE spec's TELinear(parallel_mode='duplicated') does.

    Why: with the column-parallel module MLA gathers the output over TP and keeps the rope part k_pos_emb on the
    full sequence on every rank; each rank's heads then add only their own share to k_pos_emb's gradient and the
    gather's backward (a split) drops the others, so under TP > 1 every gradient below the layer is wrong
    (megatron-core 0.16.1 and 0.19.2, local spec). With the full width, MLA takes its duplicated path, where
    gather_from_sequence_parallel_region's backward sums the heads' shares over TP. The weight is marked
    sequence_parallel (its gradient is a partial sum over the sequence shards: megatron all-reduces such weights over
    TP). Called by build.py for MLA on the local spec, before the checkpoint is loaded."""
    old = attention.linear_kv_down_proj
    cfg = attention.config
    out_rows, hidden = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, cfg.hidden_size
    attention.linear_kv_down_proj = DuplicatedLinear(hidden, out_rows, dtype=old.weight.dtype,
                                                     device=old.weight.device)


class DuplicatedLinear(torch.nn.Module):
    """y = x W^T on the local tokens, W whole on every rank; returns (y, None) like megatron's linears."""

    parallel_mode = "duplicated"

    def __init__(self, in_features: int, out_features: int, dtype=None, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.weight.sequence_parallel = True

    def forward(self, x):
        return torch.matmul(x, self.weight.t()), None


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm (x / sqrt(sum x^2 + eps) over the last dim) in torch, as transformers' delta-rule reference."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _gated_delta_net(cs: "CpuSupport") -> None:
    # GatedDeltaNet refuses to build without flash-linear-attention (HAVE_FLA) and its forward calls fla's l2norm
    # (an undefined name then) and chunk_gated_delta_rule (None then). fla is Triton (GPU); the module's own
    # torch_chunk_gated_delta_rule (a port of transformers' reference, fla's signature) takes its place on CPU.
    from megatron.core.ssm import gated_delta_net as gdn

    if not gdn.HAVE_FLA:
        cs._set(gdn, "HAVE_FLA", True)
        cs._set(gdn, "l2norm", l2norm, must_exist=False)
        cs._set(gdn, "chunk_gated_delta_rule", gdn.torch_chunk_gated_delta_rule)


def active() -> "CpuSupport | None":
    """The applied CPU support, or None."""
    return _ACTIVE


_MISSING = object()
_ACTIVE: CpuSupport | None = None


def apply() -> CpuSupport:
    """Patch megatron-core for CPU/gloo. Idempotent. Raises RuntimeError on an untested megatron-core version."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    if torch.cuda.is_available():
        raise RuntimeError("cpu_support.apply() is for CPU-only machines; a GPU is present, use the CUDA path")
    version = mcore_version()
    if not version.startswith(SUPPORTED_MCORE):
        raise RuntimeError(f"megatron-core {version} is untested on CPU; supported: {', '.join(SUPPORTED_MCORE)}x")

    from megatron.core.tensor_parallel import mappings, random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cs = CpuSupport(version)
    cs._set(torch.cuda, "current_device", lambda: "cpu")
    cs._set(torch.cuda, "Stream", _DummyStream)
    cs._set(torch.cuda, "Event", _DummyStream)
    cs._set(torch.cuda, "current_stream", lambda device=None: _DummyStream())
    cs._set(torch.cuda, "stream", _null_stream_ctx)
    cs._set(torch.cuda, "synchronize", lambda device=None: None)
    cs._set(mrandom.CudaRNGStatesTracker, "add", lambda self, name, seed: None)
    cs._set(mrandom.CudaRNGStatesTracker, "fork", _rng_fork_noop)
    tested = version.startswith("0.16.")           # activation recompute is checked on 0.16.1
    cs._set(mrandom, "_get_cuda_rng_state", _no_cuda_rng_state, must_exist=tested)
    cs._set(mrandom, "_set_cuda_rng_state", _set_no_cuda_rng_state, must_exist=tested)
    if tested:
        cs._set(mrandom.CheckpointWithoutOutput, "__init__", _checkpoint_without_output_init())
    if version.startswith("0.16.") and not hasattr(moe_utils, "te_general_gemm"):
        # 0.16.1 references te_general_gemm unconditionally although it is only imported with TE (fixed in 0.19).
        cs._set(moe_utils, "te_general_gemm", None, must_exist=False)
    cs._set(moe_utils, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)
    cs._set(token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)
    cs._set(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    cs._set(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)
    from megatron.core.transformer import multi_latent_attention as mla

    # Without Transformer Engine megatron's TE extension binds a MagicMock, so MLA's import of TELinear succeeds,
    # HAVE_TE is True and `isinstance(self.linear_proj, TELinear)` raises TypeError at construction.
    cs._set(mla, "HAVE_TE", False)
    _gated_delta_net(cs)
    if version.startswith("0.16."):
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        if gg.grouped_gemm is None:
            # the legacy GroupedMLP needs the CUDA-only `grouped_gemm` package; a pure-torch gmm stands in on CPU
            cs._set(gg, "grouped_gemm", _GmmOps)
            cs._set(gg, "ops", _GmmOps)
    _ACTIVE = cs
    return cs
