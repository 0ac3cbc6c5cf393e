"""Several adapter versions in one batch (vllm/runtime.py, moe_torch.py) without a vLLM engine: the runtime's own
linear hooks and MoE forward, installed on a tiny fake layer tree of the qwen3_moe tiny architecture, serve one step
holding tokens of three versions, the base model and an untracked request. Every token's output equals the same
tokens served as a batch of their version alone (the single-version code path) within fp32 rounding, and the routed
experts also equal vLLM-free merged weights (W + s * B @ A) routed the same way. Negative control: the tokens of one
version served with another version's adapter differ by far more than the tolerance.

Tolerance: fp32 throughout; the grouped and the single-version batches run the same math on matmuls over different
row sets, so they agree to a few ulps: rtol = atol = 1e-5 on outputs of magnitude up to ~20 (observed: <= 1.5e-6 on
the attention linear, 0 on the experts, whose per-group computation is the group's own batch); the adapters move
outputs by O(1-10), so a wrong adapter differs by more than 1e-3 (observed: > 7)."""
import numpy as np
import pytest
import torch

from moe_lora_rl.models.arch import arch_from_hf_config
from moe_lora_rl.models.naming import naming_for
from moe_lora_rl.models.tiny import build_hf_config
from moe_lora_rl.vllm.adapter_set import build_adapter_set
from moe_lora_rl.vllm.merge import merge_fp32
from moe_lora_rl.vllm.moe_torch import BaseExperts, route, routed_experts, stack_expert_lora
from moe_lora_rl.vllm.runtime import LoRARuntime
from moe_lora_rl.vllm.step_hooks import StepInfo
from moe_lora_rl.vllm.token_groups import TokenGroups
from moe_lora_rl.vllm.versions import InflightConfig, VersionTable

ARCH = arch_from_hf_config(build_hf_config("qwen3_moe", "tiny"))   # H 128, 8 experts top-2, I 64, both layers MoE
H, E, I, RANK = ARCH.hidden_size, ARCH.num_experts, ARCH.moe_ffn_hidden_size, 4
TOL = dict(rtol=1e-5, atol=1e-5)


class _Linear(torch.nn.Module):
    """vLLM's linear call convention: returns (output, bias)."""

    def __init__(self, din, dout, g):
        super().__init__()
        self.w = torch.randn(dout, din, generator=g) / din ** 0.5

    def forward(self, x):
        return x @ self.w.t(), None


class _Router:
    def __init__(self):
        self.capture_fn, self.seen = None, []

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class _Gate(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.w = torch.randn(E, H, generator=g) / H ** 0.5

    def forward(self, x):
        return x @ self.w.t(), None


class _Block(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate = _Gate(g)
        self.experts = torch.nn.Module()
        self.experts.router = _Router()
        self.experts.router.set_capture_fn(lambda ids: self.experts.router.seen.append(ids.clone()))


class _Layer(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.self_attn = torch.nn.Module()
        shapes = naming_for(ARCH).hf_shapes(ARCH, 0)
        out = sum(shapes[f"self_attn.{p}_proj"][1] for p in "qkv")
        self.self_attn.qkv_proj = _Linear(H, out, g)
        self.mlp = _Block(g)


def _base(g) -> BaseExperts:
    return BaseExperts(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5,
                       None)


def _adapter(version, g, attn=(), experts={}):
    """PEFT tensors: attention projections `attn` of layer 0; experts {layer: projections} of every expert."""
    shapes = naming_for(ARCH).hf_shapes(ARCH, 0)
    t = {}

    def pair(module, din, dout):
        pre = f"base_model.model.model.layers.{module}"
        t[f"{pre}.lora_A.weight"] = torch.randn(RANK, din, generator=g) / din ** 0.5
        t[f"{pre}.lora_B.weight"] = torch.randn(dout, RANK, generator=g) * 0.5

    for p in attn:
        pair(f"0.self_attn.{p}_proj", *shapes[f"self_attn.{p}_proj"])
    for layer, projs in experts.items():
        for e in range(E):
            for p in projs:
                pair(f"{layer}.mlp.experts.{e}.{p}_proj", *shapes[f"mlp.experts.{{E}}.{p}_proj"])
    return build_adapter_set(t, ARCH, rank=RANK, alpha=8.0, version=version)


@pytest.fixture(scope="module")
def served():
    """A pin runtime holding versions 1, 2, 3 with requests on each, one request on the base model."""
    g = torch.Generator().manual_seed(0)
    rt = LoRARuntime.__new__(LoRARuntime)
    rt.mode, rt.dtype, rt.arch = "unmerged", torch.float32, ARCH
    rt.table = VersionTable(InflightConfig("pin", 3))
    rt._init_state()
    rt.layers = [_Layer(g), _Layer(g)]
    rt.blocks = {li: layer.mlp for li, layer in enumerate(rt.layers)}
    rt._base = {li: _base(g) for li in rt.blocks}
    rt._hooks = []
    rt._install_linear_hooks()
    moe_path = lambda: ["forward" in b.__dict__ for b in rt.blocks.values()]  # noqa: E731
    rt.track([["b0", None]])                                                 # before any adapter: the base model
    rt.activate(_adapter(1, g, attn="qv", experts={0: ("gate", "up", "down")}))
    assert moe_path() == [True, False]
    rt.track([["r1a", None], ["r1b", None]])
    rt.activate(_adapter(2, g, attn="qkv", experts={0: ("down",), 1: ("gate",)}))
    assert moe_path() == [True, True]                                        # the union of the held versions' layers
    rt.track([["r2", None], ["gone", None]])
    rt.activate(_adapter(3, g, experts={0: ("gate", "up")}))                 # no attention adapter on layer 0
    rt.track([["r3a", None], ["r3b", None]])
    assert rt.table.held == [1, 2, 3]
    return rt, g


# one step: (internal request id, tokens); "u" is untracked (runs on the newest version, 3)
STEP = [("r1a", 4), ("b0", 3), ("r3a", 1), ("r2", 5), ("r1b", 2), ("r3b", 3), ("u", 2)]
VERSION = {"r1a": 1, "r1b": 1, "b0": None, "r2": 2, "r3a": 3, "r3b": 3, "u": 3}


def _info(step):
    qsl = np.cumsum([0] + [n for _, n in step])
    return StepInfo([f"{rid}-1a2b3c4d" for rid, _ in step], qsl, np.zeros(len(step), dtype=np.int64))


def _forward(rt, step, x):
    """One engine step of the fake layer: (qkv output, MoE block output, ids the router reported)."""
    info = _info(step)
    block = rt.blocks[0]
    block.experts.router.seen.clear()
    rt.before(info)
    try:
        qkv = rt.layers[0].self_attn.qkv_proj(x)[0]
        moe = block(x)
    finally:
        rt.after(info)
    assert len(block.experts.router.seen) == 1
    return qkv, moe, block.experts.router.seen[0]


def _rows(step, want):
    qsl = np.cumsum([0] + [n for _, n in step])
    return torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i, (rid, _) in enumerate(step) if rid in want])


def _single(rt, version, x, lens):
    """The same tokens served as a batch of `version` alone (fresh requests pinned to it)."""
    ids = [f"ref{version}_{i}" for i in range(len(lens))]
    if version is None:                                                       # the base model: no hook, no LoRA
        block = rt.blocks[0]
        logits = block.gate(x)[0]
        return rt.layers[0].self_attn.qkv_proj.forward(x)[0], routed_experts(x, logits, rt._base[0], ARCH, None)
    rt.track([[i, version] for i in ids])
    try:
        qkv, moe, _ = _forward(rt, list(zip(ids, lens)), x)
    finally:
        rt.release(ids)
    return qkv, moe


def test_mixed_batch_equals_single_version_batches(served):
    rt, g = served
    n = sum(k for _, k in STEP)
    x = torch.randn(n, H, generator=g)
    qkv, moe, ids = _forward(rt, STEP, x)
    assert torch.equal(ids, route(rt.blocks[0].gate(x)[0].float(), ARCH, None)[1])   # routed once, all tokens
    for version in (1, 2, 3, None):
        members = [rid for rid, _ in STEP if VERSION[rid] == version]
        rows = _rows(STEP, members)
        ref_qkv, ref_moe = _single(rt, version, x[rows], [k for rid, k in STEP if rid in members])
        torch.testing.assert_close(qkv[rows], ref_qkv, **TOL)
        torch.testing.assert_close(moe[rows], ref_moe, **TOL)
        # routed experts against merged weights (merge.py's W + s * B @ A), not the LoRA bmm path
        merged = BaseExperts(*merge_fp32(rt._base[0], rt._expert_lora(version, 0), torch.float32, 0), None)
        logits = rt.blocks[0].gate(x[rows])[0]
        torch.testing.assert_close(moe[rows], routed_experts(x[rows], logits, merged, ARCH, None), **TOL)
    # negative control: version 1's tokens served with version 2's adapter (and with 3's) are far off
    rows1 = _rows(STEP, ["r1a", "r1b"])
    for other in (2, 3):
        wrong_qkv, wrong_moe = _single(rt, other, x[rows1], [4, 2])
        assert (moe[rows1] - wrong_moe).abs().max() > 1e-3
        if other == 2:
            assert (qkv[rows1] - wrong_qkv).abs().max() > 1e-3


def test_single_version_step_takes_the_unindexed_path(served):
    """All tokens on the newest version: no plan at all; all on another version: one group without indices; the
    output is bitwise the plain single-version computation."""
    rt, g = served
    x = torch.randn(6, H, generator=g)
    rt.before(_info([("r3a", 2), ("u", 4)]))
    assert rt._step is None and rt.token_groups(6, x.device) == [(3, None)]
    rt.after(None)
    rt.before(_info([("r1a", 6)]))
    assert rt.token_groups(6, x.device) == [(1, None)]
    moe = rt.blocks[0](x)
    rt.after(None)
    logits = rt.blocks[0].gate(x)[0]
    assert torch.equal(moe, routed_experts(x, logits, rt._base[0], ARCH, rt._expert_lora(1, 0)))
    assert rt._step is None and rt.token_groups(6, x.device) == [(3, None)]   # outside a step: the newest


def test_token_groups_cover_padding_once():
    tg = TokenGroups([1, None, 1, 3], np.array([0, 2, 3, 3, 5]))
    groups = tg.groups(7, torch.device("cpu"))                     # 2 padding rows join the last request's version
    assert [(v, idx.tolist()) for v, idx in groups] == [(1, [0, 1]), (None, [2]), (3, [3, 4, 5, 6])]
    with pytest.raises(AssertionError, match="a forward of 4 tokens in a step of 5"):
        tg.groups(4, torch.device("cpu"))


def test_routed_experts_groups_match_per_group_calls():
    """moe_torch alone: groups of the same batch, each with its own ExpertLoRA (or none), equal one call per group."""
    g = torch.Generator().manual_seed(1)
    base = _base(g)
    loras = []
    for _ in range(3):
        mods = {m: (torch.randn(RANK, H if "down" not in m else I, generator=g) * 0.1,
                    torch.randn(I if "down" not in m else H, RANK, generator=g) * 0.5)
                for e in range(E) for m in naming_for(ARCH).expert_modules(e)}
        loras.append(stack_expert_lora(mods, ARCH, RANK, 2.0, torch.float32))
    x = torch.randn(30, H, generator=g)
    logits = torch.randn(30, E, generator=g)
    version = torch.randint(0, 4, (30,), generator=g)                 # 3: the base model
    groups = [(loras[v] if v < 3 else None, torch.nonzero(version == v).flatten()) for v in range(4)]
    seen = []
    out = routed_experts(x, logits, base, ARCH, None, on_route=seen.append, groups=groups)
    assert len(seen) == 1 and torch.equal(seen[0], route(logits, ARCH, None)[1])
    for lora, idx in groups:
        torch.testing.assert_close(out[idx], routed_experts(x[idx], logits[idx], base, ARCH, lora), **TOL)
    swapped = routed_experts(x[groups[0][1]], logits[groups[0][1]], base, ARCH, loras[1])
    assert (out[groups[0][1]] - swapped).abs().max() > 1e-3        # negative control: another version's factors


def test_a_non_finite_adapter_is_refused_naming_its_tensor():
    """A push holding inf or nan (a diverged policy) never serves: refused naming the tensor. Control: the same
    tensors, finite, are taken."""
    shapes = naming_for(ARCH).hf_shapes(ARCH, 0)
    din, dout = shapes["self_attn.q_proj"]
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    t = {f"{pre}.lora_A.weight": torch.ones(RANK, din), f"{pre}.lora_B.weight": torch.ones(dout, RANK)}
    assert build_adapter_set(t, ARCH, rank=RANK, alpha=8.0, version=3).version == 3
    t[f"{pre}.lora_B.weight"][1, 0] = float("nan")
    with pytest.raises(ValueError, match=f"adapter version 3: tensor '{pre}.lora_B.weight' holds non-finite"):
        build_adapter_set(t, ARCH, rank=RANK, alpha=8.0, version=3)


def test_an_integer_adapter_tensor_is_refused_naming_it():
    """An integer factor (a sender that cast to the wrong dtype) was converted and served; now refused naming the
    tensor. Control: the same values as float32 are taken."""
    shapes = naming_for(ARCH).hf_shapes(ARCH, 0)
    din, dout = shapes["self_attn.q_proj"]
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    t = {f"{pre}.lora_A.weight": torch.ones(RANK, din), f"{pre}.lora_B.weight": torch.ones(dout, RANK)}
    assert build_adapter_set(t, ARCH, rank=RANK, alpha=8.0, version=3).version == 3
    t[f"{pre}.lora_A.weight"] = t[f"{pre}.lora_A.weight"].to(torch.int32)
    with pytest.raises(ValueError, match=f"adapter tensor '{pre}.lora_A.weight' has dtype torch.int32"):
        build_adapter_set(t, ARCH, rank=RANK, alpha=8.0, version=3)


def test_the_finite_check_in_groups_names_the_tensor(monkeypatch):
    """The tensors are checked in groups of at most _FINITE_CHUNK elements: an inf in a later group is found and
    named; a nan in the first tensor too; all finite passes."""
    from moe_lora_rl.vllm import adapter_set

    monkeypatch.setattr(adapter_set, "_FINITE_CHUNK", 10)
    t = {f"t{i}": torch.ones(2, 3) for i in range(9)}
    adapter_set._check_finite(t, 1)
    t["t6"][1, 2] = float("-inf")
    with pytest.raises(ValueError, match="adapter version 1: tensor 't6' holds non-finite"):
        adapter_set._check_finite(t, 1)
    t["t0"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="tensor 't0' holds non-finite"):
        adapter_set._check_finite(t, 1)
