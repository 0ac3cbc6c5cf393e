"""megatron-core options that change how the MoE block computes, at expert- and tensor-parallel layouts: one LoRA
forward + backward (every target, B non-zero so that every factor has a gradient) equals the plain layout (tp1, fp32):
logits within LAYOUT_LOGITS_REL of the largest reference logit, every adapter factor's gradient non-zero and within
GRAD_SPLIT of the reference's (relative to its largest entry). Model: glm4_moe tiny (a shared expert, a dense first
layer, 16 experts top-4).

Regressions covered (Megatron-Bridge's 2026 fix, the same kind): an expert or shared-expert delta added once per rank
at expert_tensor_parallel_size > 1 or TP > 1 with moe_shared_expert_overlap, or detached from autograd. Before the
fix here, TP2 with moe_shared_expert_overlap failed in the shared expert's adapter (its rank-r activation gathered a
second time: "size of tensor a (32) must match ... b (64)"). Negative controls on the same models: the routed expert
fc2 delta doubled on the second ETP rank, the shared fc1 delta doubled on the second TP rank, the shared fc2 delta
detached; each must fail the comparison.
"""
import pytest

from moe_lora_rl.checks.tolerances import GRAD_SPLIT, LAYOUT_LOGITS_REL
from moe_lora_rl.megatron.cpu_support import mcore_version

# the legacy GroupedMLP is megatron-core 0.16's (a mark, not a skip in the fixture: the job then joins no launch)
pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_version().startswith("0.16."),
                                                    reason="grouped GEMM on the local spec needs megatron-core 0.16")]
CFG = {"rank": 4, "alpha": 8.0}


def _models():
    from moe_lora_rl.models import get_model

    return [str(get_model("glm4_moe", "tiny"))]


def _argv(workdir):
    from kit.moe_options_check import VARIANTS, worker_argv
    from moe_lora_rl.lora import LoRAConfig

    return worker_argv(_models(), VARIANTS, LoRAConfig(**CFG), workdir)


# in one launch with the other 2-rank workers on the tiny models (tests/conftest.py)
LAUNCH = {"moe_options": {"nproc": 2, "module": "kit.moe_options_worker", "args": _argv}}


def _check_equal(report, names):
    assert set(names) <= set(report), sorted(set(names) - set(report))
    for name in names:
        for m, r in report[name].items():
            assert r["zero_grads"] == [], (name, m, r["zero_grads"][:6])
            assert r["logits_rel_diff"] <= LAYOUT_LOGITS_REL, (name, m, r)
            assert r["grad_max_rel_diff"] <= GRAD_SPLIT, (name, m, r)


@pytest.fixture(scope="module")
def report(shared_launch):
    from kit.moe_options_check import VARIANTS, report as compared

    summary, workdir = shared_launch("moe_options")
    return compared(_models(), VARIANTS, workdir, summary)


def test_moe_options_equal_plain_layout(report):
    from kit.moe_options_check import VARIANTS

    _check_equal(report, [v["name"] for v in VARIANTS])


def test_controls_fail(report):
    """A delta counted twice on one rank moves logits and gradients; a detached one leaves logits and takes the
    gradients of its factors to zero."""
    for name in ("etp2+double:expert_fc2", "tp2_overlap+double:shared_fc1", "tp2_overlap+detach:shared_fc2"):
        for m, r in report[name].items():
            assert r["broken_adapters"] > 0, (name, m)
            assert r["grad_max_rel_diff"] > 100 * GRAD_SPLIT, (name, m, r)
            if name.startswith("tp2_overlap+detach"):
                assert r["zero_grads"] and all("shared_experts.linear_fc2" in k for k in r["zero_grads"]), (name, r)
            else:
                assert r["logits_rel_diff"] > 100 * LAYOUT_LOGITS_REL, (name, m, r)


@pytest.mark.slow
def test_more_moe_options_equal_plain_layout(tmp_path_factory):
    """tp2, tp2etp2 with overlap, ep2 with overlap, the allgather dispatcher at tp2 and etp2, etp2 grouped GEMM."""
    from kit.moe_options_check import MORE_VARIANTS, REFERENCE, run
    from moe_lora_rl.lora import LoRAConfig

    report = run(_models(), [{"name": REFERENCE, "layout": "tp1"}] + MORE_VARIANTS, LoRAConfig(**CFG),
                 tmp_path_factory.mktemp("moe_options"))
    _check_equal(report, [v["name"] for v in MORE_VARIANTS])
