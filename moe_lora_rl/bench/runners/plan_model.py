"""The planner's models against the benches' measurements (pure): bench plan's step model (the run's settings,
hardware figures calibrated so the planner reproduces the measured rollout and training times at one batch, the
planner's step at another, the predicted against the measured rate), and bench async's answer lengths (the
planner's HostLengths from the synchronous run, and the occupancy a lognormal of its mean and p90 implies)."""
from __future__ import annotations

import os

from ...plan.search import RolloutLayout, TrainLayout, decode_traffic, step_times, train_flops_per_token
from ...plan.specs import Hardware, ModelSpec, RLSettings
from .jobs import phases


def settings(batch: int, prompt_len: int, response_len: int, rank: int) -> RLSettings:
    return RLSettings(batch=batch, prompt_len=prompt_len, response_len=response_len, rank=rank, mode="sync",
                      staleness=0, micro_batch=1, recompute=False)


def one_device(rl: RLSettings) -> tuple[TrainLayout, RolloutLayout]:
    return (TrainLayout(1, 1, 1, 1, 1, 1, rl.batch, {}),
            RolloutLayout(1, 1, 1, 1, 1, rl.batch, {}))


def calibrate(m: ModelSpec, rl: RLSettings, rollout_s: float, train_s: float, peak_flops: float,
              weight_bytes: float = 2) -> Hardware:
    """Hardware figures that make the planner reproduce the measured rollout and training times at rl.batch."""
    _, r = one_device(rl)
    nbytes, flops = decode_traffic(m, rl, r, rl.batch, weight_bytes)
    step = rollout_s / rl.response_len
    train_flops = rl.batch * rl.seq_len * train_flops_per_token(m, rl) / train_s
    decode_flops = max(peak_flops, flops / step)
    if flops / decode_flops >= step * (1 - 1e-9):        # compute bound even at this ceiling: memory no limit
        bw = 1e6 * nbytes / step
    else:
        bw = nbytes / step
    peak = max(decode_flops, train_flops)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return Hardware(memory_GB=ram, usable_fraction=1.0, bf16_TFLOPs=peak / 1e12, hbm_GBps=bw / 1e9,
                    train_mfu=train_flops / peak, decode_bw_eff=1.0, decode_flops_eff=decode_flops / peak,
                    gpus_per_node=1, source=f"calibrated by `bench plan` at batch {rl.batch}")


def predict(m: ModelSpec, hw: Hardware, rl: RLSettings, weight_bytes: float = 2) -> dict:
    """The planner's synchronous step (rollout + training, no refit) on one device at rl.batch."""
    t, r = one_device(rl)
    s = step_times(m, hw, rl, t, r, 0.0, weight_bytes)
    return {"step_s": s["sync_step_s"], "rollout_s": s["rollout_sync_s"], "train_s": s["train_s"]}


def compare(predicted_step_s: float, measured_step_s: float, b1: int, b2: int) -> dict:
    p, m = 60 / predicted_step_s, 60 / measured_step_s
    return {"predicted_steps_per_min": p, "measured_steps_per_min": m, "error": abs(p - m) / m,
            "calibration_batch": b1, "predicted_batch": b2}


def run_lengths(sync: dict, one_core: dict, batch: int, cap: int):
    """HostLengths of the measured synchronous rollout (plan/shared_host.py), or None where the runs lack what it
    needs: the trained answers' mean length, the batch's longest answer as the sync run's occupancy gives it
    (batch * mean / occupancy: what the distribution's tail sets), phi from the one-core run's fitted decode step
    (the async engine's placement: one thread) and the engine's share of that run's rollout seconds."""
    from ...plan.lengths import parse_lengths
    from ...plan.shared_host import HostLengths

    fit, mean, occ = one_core.get("engine_step_fit"), sync.get("response_len_mean"), sync.get("engine_occupancy")
    rollout_s = phases(one_core)[0] * one_core["steps"]
    if not fit or not mean or not occ or not one_core.get("engine_decode_s") or rollout_s <= 0:
        return None
    return HostLengths.from_fit(parse_lengths(f"{min(mean, cap):.6g}", cap), batch, fit,
                                min(1.0, one_core["engine_decode_s"] / rollout_s), occupancy=min(max(occ, 1.0), batch))


def spec_occupancy(sync: dict, batch: int, cap: int) -> dict | None:
    """The synchronous occupancy a lognormal of the sync run's answer mean and 90th percentile alone implies (the
    planner's length model without the run's occupancy), or None where they make no tail."""
    from ...plan.lengths import parse_lengths
    from ...plan.shared_host import HostLengths

    mean, p90 = sync.get("response_len_mean"), sync.get("len_p90")
    try:
        d = parse_lengths(f"mean={mean:.6g},p90={p90:.6g}", cap)
    except (ValueError, TypeError):
        return None
    return {"spec": d.spec, "occupancy_sync": HostLengths(d, batch).occupancy_sync()}
