"""R3 inside verl from our capture, without an engine: the worker ranks' routes merged into verl's routed_experts
layout (int16, [tokens, MoE layers, top-k]), what verl's agent loop then does with them (left-padding placement),
and what our trainer engine reads back (routes_from_verl) equal to the capture; bad shapes and ranks that disagree
are errors naming the request. The in-run k3 check and its negative control."""
import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.verl


def _wire(r):
    return [r.dtype.str, list(r.shape), r.tobytes()]


def test_ranks_merge_by_layer_into_verls_layout():
    from moe_lora_rl.integration.verl.server_routes import merge_meta, merge_routes

    rng = np.random.default_rng(0)
    full = rng.integers(0, 128, (9, 3, 8)).astype(np.uint8)       # 9 forwarded tokens, MoE layers 1, 2, 3
    # pipeline stages (layers 1 | 2, 3) and a tensor-parallel twin of the first stage
    metas = [{"layer_ids": [1], "num_experts": 128, "topk": 8}, {"layer_ids": [2, 3], "num_experts": 128, "topk": 8},
             {"layer_ids": [1], "num_experts": 128, "topk": 8}]
    meta = merge_meta(metas)
    assert meta["layer_ids"] == [1, 2, 3]
    parts = [{"r": _wire(full[:, :1])}, {"r": _wire(full[:, 1:])}, {"r": full[:, :1].copy()}]
    out = merge_routes(meta, parts, "r", 9)
    assert out.dtype == np.int16 and np.array_equal(out, full.astype(np.int16))
    twin = full[:, :1].copy()
    twin[4, 0, 0] ^= 1                                            # negative control: the twin saw another route
    with pytest.raises(RuntimeError, match="disagree on the routes of layer 1 for request 'r'"):
        merge_routes(meta, [parts[0], parts[1], {"r": twin}], "r", 9)
    with pytest.raises(RuntimeError, match=r"request 'r' routes of shape \(9, 1, 8\) on worker rank 0, expected "
                                           r"\(10, 1, 8\)"):
        merge_routes(meta, parts, "r", 10)
    with pytest.raises(RuntimeError, match="worker rank 1 has no routes for request 'r'"):
        merge_routes(meta, [parts[0], {}, parts[2]], "r", 9)
    with pytest.raises(RuntimeError, match="disagree on experts/top-k"):
        merge_meta([metas[0], {"layer_ids": [2], "num_experts": 64, "topk": 8}])
    with pytest.raises(ValueError, match="40000 experts do not fit verl's int16"):
        merge_meta([{"layer_ids": [1], "num_experts": 40000, "topk": 8}])


def test_verls_agent_loop_placement_reads_back_as_the_capture():
    """What verl's agent loop does with TokenOutput.routed_experts (int16, placed at the left-padding offset of a
    [1, prompt_pad + response_pad] row) and verl's no-padding conversion, read by our engine's routes_from_verl."""
    from moe_lora_rl.integration.verl.routes_dataproto import routes_from_verl

    rng = np.random.default_rng(1)
    n_prompt, n_resp, prompt_pad, resp_pad = 5, 4, 8, 6
    captured = rng.integers(0, 16, (n_prompt + n_resp - 1, 2, 4)).astype(np.int16)
    row = torch.zeros(1, prompt_pad + resp_pad, 2, 4, dtype=torch.int16)
    start = prompt_pad - n_prompt
    row[:, start:start + len(captured)] = torch.from_numpy(captured)
    attention = torch.zeros(prompt_pad + resp_pad, dtype=torch.bool)
    attention[start:prompt_pad + n_resp] = True
    real = row[0][attention]                                   # verl's left_right_2_no_padding keeps these rows
    got = routes_from_verl([real], [n_prompt + n_resp], num_layers=3, moe_layer_ids=[1, 2], num_experts=16, topk=4)
    assert np.array_equal(got.samples[0], captured)
    # negative control: routes placed one position off (a wrong padding offset) read back as other routes
    off = torch.zeros_like(row)
    off[:, start + 1:start + 1 + len(captured)] = torch.from_numpy(captured)[: prompt_pad + resp_pad - start - 1]
    bad = routes_from_verl([off[0][attention]], [n_prompt + n_resp], num_layers=3, moe_layer_ids=[1, 2],
                           num_experts=16, topk=4)
    assert not np.array_equal(bad.samples[0], captured)


def test_server_routes_pop_and_discard_through_collective_rpc():
    from moe_lora_rl.integration.verl.server_routes import ServerRoutes

    full = np.arange(5 * 2 * 4).reshape(5, 2, 4).astype(np.uint8) % 16

    class Engine:
        def __init__(self):
            self.calls = []

        async def collective_rpc(self, method, args=()):
            self.calls.append((method, args))
            if method == "moe_lora_capture_start":
                return [{"layer_ids": [1, 2], "num_experts": 16, "topk": 4}]
            if method == "moe_lora_capture_pop":
                assert args == (["q"], True)                    # the wire form: arrays survive the engine core
                return [{"q": _wire(full)}]
            return [{"discarded": 1}]

    async def run():
        eng, routes = Engine(), ServerRoutes()
        await asyncio.gather(routes.start(eng), routes.start(eng))
        out = await routes.pop(eng, "q", 5)
        await routes.discard(eng, "x")
        return eng, out

    eng, out = asyncio.run(run())
    assert [c[0] for c in eng.calls].count("moe_lora_capture_start") == 1       # started once
    assert np.array_equal(out, full.astype(np.int16)) and eng.calls[-1] == ("moe_lora_capture_discard", (["x"],))


def test_shifted_routes_roll_each_sample_and_leave_the_batch_alone():
    from tensordict import TensorDict

    from moe_lora_rl.integration.verl.r3_check import shifted_routes

    rows = [torch.arange(n * 2 * 4).reshape(n, 2, 4).to(torch.int16) for n in (3, 5)]
    data = TensorDict({"routed_experts": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[2])
    got = list(shifted_routes(data)["routed_experts"].unbind())
    assert all(torch.equal(g, torch.roll(r, 1, dims=0)) for g, r in zip(got, rows))
    assert all(torch.equal(g, r) for g, r in zip(data["routed_experts"].unbind(), rows))     # the original kept


def test_k3_check_and_its_negative_control():
    from moe_lora_rl.integration.verl.r3_check import k3_stats

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 6, generator=g) * 3
    mask = torch.ones(3, 6)
    mask[2, 4:] = 0
    same = k3_stats(rollout.clone(), rollout, mask)
    assert same["k3"] == 0.0 and same["max_abs_diff"] == 0.0
    flipped = rollout.clone()
    flipped[1, 2] -= 0.5                                        # one token whose expert flipped
    flipped[2, 5] -= 9.0                                        # masked: never counted
    s = k3_stats(flipped, rollout, mask)
    d = torch.tensor(-0.5, dtype=torch.float64)
    assert s["k3"] == pytest.approx(float(torch.exp(d) - 1 - d) / 16) and s["max_abs_diff"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no response tokens"):
        k3_stats(rollout, rollout, torch.zeros(3, 6))


def test_r3_check_records_the_actors_recomputes_and_not_the_references(monkeypatch, tmp_path):
    """With a KL loss verl recomputes the reference policy (adapters disabled) through the same engine: that
    policy is not the one that sampled, so the check records the actor's recomputes only (a trained adapter made the
    reference's lines read as k3 0.05 beside the actor's 2e-12)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from moe_lora_rl.integration.verl import engine as eng_mod, r3_check

    recorded = []
    monkeypatch.setattr(r3_check, "record", lambda *a, **k: recorded.append(a))
    eng = eng_mod.MoELoRAEngine.__new__(eng_mod.MoELoRAEngine)
    eng.engine_config = SimpleNamespace(router_replay=SimpleNamespace(mode="R3"), r3_check_log=str(tmp_path / "x"))
    eng.core = SimpleNamespace(adapters=lambda on: nullcontext())
    eng.reference_scope, eng.version = False, 3
    eng._run_batch = lambda data, loss_fn, forward_only, replay: {"model_output": {}}
    monkeypatch.setattr(r3_check, "shifted_routes", lambda d: d)

    def batch():
        d = TensorDict({"rollout_log_probs": torch.zeros(2, 3)}, batch_size=[2])
        tu.assign_non_tensor(d, enable_routing_replay=True)
        return d

    eng.forward_backward_batch(batch(), None, forward_only=True)
    assert len(recorded) == 1                                    # the actor's recompute: checked
    with eng.disable_adapter():
        eng.forward_backward_batch(batch(), None, forward_only=True)
    assert len(recorded) == 1 and eng.reference_scope is False   # the reference's: left out, and the scope closed
    eng.forward_backward_batch(batch(), None, forward_only=True)
    assert len(recorded) == 2


def test_r3_check_runs_its_passes_on_every_pipeline_stage(monkeypatch, tmp_path):
    """A stage before the last returns no log-probs ({}); it must still run the check's two extra passes, or the last
    stage waits for their activations forever (a PP2 resume inside verl hung in recv_forward). Only the last stage
    records."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from moe_lora_rl.integration.verl import engine as eng_mod, r3_check

    recorded, passes = [], {"first": 0, "last": 0}
    monkeypatch.setattr(r3_check, "record", lambda *a, **k: recorded.append(a))
    monkeypatch.setattr(r3_check, "shifted_routes", lambda d: d)
    for stage, out in (("first", {}), ("last", {"model_output": {}})):
        eng = eng_mod.MoELoRAEngine.__new__(eng_mod.MoELoRAEngine)
        eng.engine_config = SimpleNamespace(router_replay=SimpleNamespace(mode="R3"), r3_check_log=str(tmp_path / "x"))
        eng.core = SimpleNamespace(adapters=lambda on: nullcontext())
        eng.reference_scope, eng.version = False, 3

        def run(data, loss_fn, forward_only, replay, stage=stage, out=out):
            passes[stage] += 1
            return out

        eng._run_batch = run
        d = TensorDict({"rollout_log_probs": torch.zeros(2, 3)}, batch_size=[2])
        tu.assign_non_tensor(d, enable_routing_replay=True)
        eng.forward_backward_batch(d, None, forward_only=True)
    assert passes == {"first": 3, "last": 3} and len(recorded) == 1
