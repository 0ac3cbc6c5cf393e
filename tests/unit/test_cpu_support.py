import importlib.util

import pytest
import torch

from kit.import_inert import IMPORT_CHECK, facts
from moe_lora_rl.megatron import cpu_support




@pytest.mark.skipif(importlib.util.find_spec("verl") is not None,
                    reason="with verl installed, tests/unit/test_verl_config.py::test_plugin_is_inert_unless_imported "
                           "runs this same check in the interpreter it starts anyway (one fewer import of everything)")
def test_nothing_applied_at_import():
    """Importing every module of the package (in a fresh interpreter) replaces no attribute of torch.cuda or of the
    megatron-core modules and classes cpu_support or the replay hooks touch (tests/kit/import_inert.py)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = facts(proc.stdout)
    assert int(out["IMPORTED"]) > 20, out
    assert out["CHANGED"] == "[]", out


def test_apply_is_explicit_idempotent_and_restorable():
    before = torch.cuda.current_device
    h = cpu_support.apply()
    assert cpu_support.apply() is h
    assert torch.cuda.current_device() == "cpu"
    from megatron.core.tensor_parallel import mappings
    assert mappings._gather_along_first_dim is cpu_support._gather_along_first_dim
    h.restore()
    assert torch.cuda.current_device is before
    assert mappings._gather_along_first_dim is not cpu_support._gather_along_first_dim


def test_untested_version_refused(monkeypatch):
    monkeypatch.setattr(cpu_support, "mcore_version", lambda: "0.12.0")
    monkeypatch.setattr(cpu_support, "_ACTIVE", None)
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 is untested"):
        cpu_support.apply()


def test_device_mode_rewrites_cuda_kwargs():
    h = cpu_support.apply()
    try:
        with h.cuda_device_kwargs_to_cpu():
            t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu"
    finally:
        h.restore()


def _per_group(a, b, sizes, trans_b):
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(torch.split(a, sizes), b.unbind(0))]
    return torch.cat(outs, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_b", [True, False])
def test_torch_gmm_equals_a_matmul_per_group_forward_and_backward(dtype, trans_b):
    """torch_gmm (torch._grouped_mm where it takes the operands, e.g. the experts' 256 -> 128 and LoRA's rank-8
    factors; a matmul per group for rows of 12 bytes) gives the per-group matmuls' output and gradients bit for bit,
    an empty group and sum's expanded gradient included. Control: the same rows with the group sizes of another
    routing give another output."""
    from moe_lora_rl.megatron.cpu_support import _grouped_mm_takes, torch_gmm

    g = torch.Generator().manual_seed(0)
    for k, n in ((256, 128), (256, 8), (8, 64), (3, 5)):
        sizes = [5, 0, 9, 1, 7, 2]
        a = torch.randn(sum(sizes), k, generator=g).to(dtype)
        b = torch.randn(len(sizes), *((n, k) if trans_b else (k, n)), generator=g).to(dtype)
        got, want = [], []
        for f, out in ((lambda x, w: torch_gmm(x, w, torch.tensor(sizes), trans_b), got),
                       (lambda x, w: _per_group(x, w, sizes, trans_b), want)):
            x, w = a.clone().requires_grad_(), b.clone().requires_grad_()
            y = f(x, w)
            y.sum().backward()
            out += [y.detach(), x.grad, w.grad]
        assert all(torch.equal(p, q) for p, q in zip(got, want)), (k, n)
        assert _grouped_mm_takes(a, b.transpose(1, 2) if trans_b else b) == ((k, n) != (3, 5))
        other = torch_gmm(a, b, torch.tensor([9, 1, 5, 0, 2, 7]), trans_b)
        assert not torch.equal(other, got[0])


def test_gated_delta_net_runs_on_the_torch_delta_rule_as_hf_computes_it():
    """Without flash-linear-attention, apply() lets GatedDeltaNet build (HAVE_FLA) and binds its l2norm and
    chunk_gated_delta_rule to torch: on the same q, k, v, g, beta they give transformers' reference (qwen3_5_moe's
    torch_chunk_gated_delta_rule with its in-kernel l2norm) within fp32 rounding; restore() puts fla's absence back."""
    from megatron.core.ssm import gated_delta_net as gdn
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule as hf_rule

    if gdn.HAVE_FLA and cpu_support.active() is None:
        pytest.skip("flash-linear-attention is installed: nothing to bind")
    was_active = cpu_support.active() is not None
    state = lambda: (gdn.HAVE_FLA, gdn.chunk_gated_delta_rule, getattr(gdn, "l2norm", None))   # noqa: E731
    before = state()               # 0.16.1: l2norm undefined without fla; 0.19 defines one of its own
    h = cpu_support.apply()
    try:
        assert gdn.HAVE_FLA and gdn.chunk_gated_delta_rule is gdn.torch_chunk_gated_delta_rule
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 70, 4, 32, generator=gen) for _ in range(3))   # two chunks of 64
        g, beta = -3 * torch.rand(2, 70, 4, generator=gen), torch.rand(2, 70, 4, generator=gen)
        got, _ = gdn.chunk_gated_delta_rule(gdn.l2norm(q), gdn.l2norm(k), v, g=g, beta=beta, initial_state=None,
                                            output_final_state=False, use_qk_l2norm_in_kernel=False)
        ref, _ = hf_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()
    finally:
        if not was_active:
            h.restore()
            assert all(a is b for a, b in zip(state(), before)) and not gdn.HAVE_FLA
            assert gdn.chunk_gated_delta_rule is None
