"""Response lengths in the planner: the order-statistics formulas against a seeded Monte-Carlo of the same
distribution, the negative control (one length: sync == async rollout time per sample), the shared-host and GPU
models with lengths, the invariants in the CLI's JSON, and bad distributions / admission ahead as one-line errors.

Tolerances: the Monte-Carlo mean of R = 4000 batches has a standard error of about sd/sqrt(R); we allow 4 standard
errors plus 0.5% for the lognormal's binning (1500 geometric bins, each at its conditional mean). The multi-wave
sync formula is a fluid approximation: allowed 10%."""
import json
import math

import numpy as np
import pytest

from moe_lora_rl.plan import formulas as F
from moe_lora_rl.plan.cli import main
from moe_lora_rl.plan.lengths import parse_lengths
from moe_lora_rl.plan.shared_host import HostLengths, HostPhases, predict

CAP = 16384
R = 4000


def _draw(spec: str, rng, size):
    """Draws from the distribution as stated (the continuous lognormal, not the planner's bins), clipped at CAP."""
    if "=" in spec:
        d = parse_lengths(spec, CAP)
        mu, sigma = _lognormal_params(spec)
        return np.minimum(rng.lognormal(mu, sigma, size), CAP), d
    d = parse_lengths(spec, CAP)
    return rng.choice(np.array(d.values), size=size, p=np.array(d.probs)), d


def _lognormal_params(spec):
    from statistics import NormalDist
    kv = dict(p.split("=") for p in spec.split(","))
    mean, q = float(kv["mean"]), next(k for k in kv if k != "mean")
    z, r = NormalDist().inv_cdf(float(q[1:]) / 100), float(kv[q]) / mean
    sigma = z - math.sqrt(z * z - 2 * math.log(r))
    return math.log(mean) - sigma * sigma / 2, sigma


def _mc_sync(lengths, step):
    """Sum over the decode steps of step(answers still running), from sorted draws."""
    s = np.sort(lengths, axis=1)
    n = s.shape[1]
    gaps = np.diff(np.concatenate([np.zeros((s.shape[0], 1)), s], axis=1), axis=1)
    return (gaps * np.array([step(n - j) for j in range(n)])).sum(axis=1)


STEP = lambda k: 0.02 + 0.001 * math.sqrt(k)          # concave: weights read once, KV and experts grow with k


@pytest.mark.parametrize("spec", ["mean=4096,p99=16384", "60:0.8,380:0.2", "40:1,100:1,400:1"])
@pytest.mark.parametrize("n", [16, 256])
def test_sync_time_and_longest_answer_match_monte_carlo(spec, n):
    rng = np.random.default_rng(0)
    x, d = _draw(spec, rng, (R, n))
    tol = lambda sample: 4 * sample.std() / math.sqrt(R) + 0.005 * sample.mean()
    mx = x.max(axis=1)
    assert abs(d.expected_max(n) - mx.mean()) < tol(mx)
    assert abs(d.mean - x.mean()) < 4 * x.std() / math.sqrt(x.size) + 0.005 * x.mean()
    mc = _mc_sync(x, STEP)
    assert abs(F.shrinking_batch_seconds(d.alive_steps(n), STEP) - mc.mean()) < tol(mc)
    assert sum(d.alive_steps(n)) == pytest.approx(d.expected_max(n), rel=1e-9)
    # the long tail costs: a sync batch waits for the longest answer, far above the mean
    assert d.expected_max(n) > 2 * d.mean


def test_async_full_occupancy_matches_a_simulated_engine():
    """An engine of c slots refilled at once: the engine time per finished answer tends to mean * step(c) / c."""
    rng = np.random.default_rng(1)
    spec, c, total = "mean=4096,p99=16384", 64, 40000
    x, d = _draw(spec, rng, total)
    ends = np.zeros(c)                                   # each slot's busy-until (in decode steps)
    for L in x:                                          # the next answer takes the slot that frees first
        i = ends.argmin()
        ends[i] += L
    steps = ends.max()
    per_sample = steps * STEP(c) / total
    model = F.full_occupancy_seconds_per_sample(d.mean, c, STEP(c))
    assert per_sample == pytest.approx(model, rel=0.01)


def test_multi_wave_sync_is_within_ten_percent_of_a_simulation():
    rng = np.random.default_rng(2)
    d = parse_lengths("mean=4096,p99=16384", CAP)
    n, c, reps = 512, 128, 300
    times = []
    for _ in range(reps):
        x, _ = _draw("mean=4096,p99=16384", rng, n)
        ends, t, events = np.zeros(c), 0.0, []
        ends[:] = x[:c]
        queue = list(x[c:])
        # event simulation in decode steps, summing step(k) over the steps with k running
        running = list(ends)
        now = 0.0
        while running:
            nxt = min(running)
            t += (nxt - now) * STEP(len(running))
            now = nxt
            running.remove(nxt)
            if queue:
                running.append(now + queue.pop())
        times.append(t)
    model = F.rollout_sync_seconds_lengths(n, c, d, STEP)
    assert model == pytest.approx(np.mean(times), rel=0.10)


@pytest.mark.parametrize("n, c", [(16, 16), (512, 512), (512, 128)])
def test_negative_control_one_length_sync_equals_async_per_sample(n, c):
    d = parse_lengths("4096", CAP)
    assert d.fixed and d.expected_max(n) == d.mean == 4096
    sync_per_sample = F.rollout_sync_seconds_lengths(n, c, d, STEP) / n
    assert sync_per_sample == pytest.approx(F.full_occupancy_seconds_per_sample(d.mean, c, STEP(c)), rel=1e-12)
    ph = HostPhases(rollout_1=10.1, rollout_c=11.4, train_1=28.5, train_c=14.2, cores=2)
    assert predict(ph, 1, HostLengths(d, n, 0.3))["async_step_s"] == predict(ph, 1)["async_step_s"]


def test_shared_host_long_tail_speeds_async_only():
    ph = HostPhases(rollout_1=10.0, rollout_c=10.0, train_1=4.0, train_c=2.0, cores=2)
    mix = HostLengths(parse_lengths("60:0.8,380:0.2", CAP), 16, 1.0)
    base, long = predict(ph, 4), predict(ph, 4, mix)
    assert long["sync_step_s"] == base["sync_step_s"]         # sync is measured: lengths do not change it
    f = mix.dist.mean / mix.dist.expected_max(16)             # phi = 1: steps are all equal, sync = E[max] steps
    assert long["async_rollout_factor"] == pytest.approx(f) and f < 0.4
    # bounds: cores (10 f + 4) / 2, rollout 10 f, train 2, staleness 10 g / 4
    assert long["async_step_s"] == pytest.approx(max((10 * f + 4) / 2, 10 * f, 2.0, 10 * mix.longest_factor() / 4))
    assert long["predicted_speedup"] > 1.5 * base["predicted_speedup"]
    # phi = 0 (compute-bound decode): the shrinking batch is cheap, async gains less
    assert HostLengths(mix.dist, 16, 0.0).async_factor() > f
    # a bound of 1 holds the longest answer to one step: staleness binds
    tight = predict(ph, 1, mix)
    assert tight["limit"] == "staleness" and tight["implied_staleness"] == 1


def test_shared_host_engine_share_and_fitted_decode_step():
    """Only the engine's share e of the rollout shrinks with the batch (1 - e + e f); phi from a fitted step cost;
    the synchronous occupancy the lengths imply against a simulated shrinking batch."""
    mix = parse_lengths("60:0.8,380:0.2", CAP)
    full, half = HostLengths(mix, 16, 0.4), HostLengths(mix, 16, 0.4, engine_frac=0.5)
    f = full.async_factor()
    assert half.async_factor() == pytest.approx(0.5 + 0.5 * f) and half.longest_factor() == pytest.approx(
        0.5 * full.longest_factor())
    fit = {"fixed_s": 0.006, "per_seq_s": 0.0005}
    assert HostLengths.from_fit(mix, 16, fit).fixed_frac == pytest.approx(0.006 / (0.006 + 0.008))
    assert HostLengths.from_fit(mix, 16, {"fixed_s": -1e-4, "per_seq_s": 0.001}).fixed_frac == 0.0
    with pytest.raises(ValueError, match="engine_frac=0"):
        HostLengths(mix, 16, 0.4, engine_frac=0)
    with pytest.raises(ValueError, match="must cost some seconds"):
        HostLengths.from_fit(mix, 16, {"fixed_s": 0.0, "per_seq_s": -1.0})
    # occupancy: batches of 16 answers drawn from the mix, each decoded until its longest ends
    rng = np.random.default_rng(0)
    draws = rng.choice(mix.values, p=mix.probs, size=(20000, 16))
    sim = draws.sum() / draws.max(axis=1).sum()
    assert full.occupancy_sync() == pytest.approx(sim, rel=0.01)
    assert HostLengths(parse_lengths("200", CAP), 16).occupancy_sync() == pytest.approx(16)     # control: no tail


@pytest.mark.parametrize("spec", ["60:0.8,380:0.2", "mean=151,p90=252", "200"])
def test_sync_steps_closed_form_is_the_shrinking_batch_sum(spec):
    """sum_k G_k (phi + (1 - phi) k / n) = phi E[max] + (1 - phi) mean; a measured occupancy stands in for E[max]."""
    d = parse_lengths(spec, 400)
    for phi in (0.0, 0.37, 1.0):
        ln = HostLengths(d, 32, phi)
        ref = F.shrinking_batch_seconds(d.alive_steps(32), lambda k: phi + (1 - phi) * k / 32)
        assert ln.sync_steps() == pytest.approx(ref, rel=1e-9)
        same = HostLengths(d, 32, phi, occupancy=ln.occupancy_sync())
        assert same.sync_steps() == pytest.approx(ref, rel=1e-9)
        assert same.async_factor() == pytest.approx(ln.async_factor(), rel=1e-9)
    # a measured occupancy under the distribution's own (a longer tail than it holds): async gains more
    ln = HostLengths(d, 32, 0.5)
    slower = HostLengths(d, 32, 0.5, occupancy=0.5 * ln.occupancy_sync())
    assert slower.longest() == pytest.approx(2 * ln.longest()) and slower.async_factor() < ln.async_factor()
    with pytest.raises(ValueError, match="occupancy=40"):
        HostLengths(d, 32, 0.5, occupancy=40)
    # the async engine at occupancy n is the default; under it a batch costs more and its longest answer less
    full = HostLengths(d, 32, 0.5, occupancy_async=32)
    assert (full.async_factor(), full.longest_factor()) == pytest.approx((ln.async_factor(), ln.longest_factor()))
    part = HostLengths(d, 32, 0.5, occupancy_async=16)
    assert part.async_factor() == pytest.approx(ln.async_factor() * (0.5 * 2 + 0.5))
    assert part.longest_factor() == pytest.approx(ln.longest_factor() * (0.5 + 0.5 * 0.5))
    # at the synchronous occupancy the pipeline gains nothing: the same steps at the same cost
    assert HostLengths(d, 32, 0.5, occupancy_async=ln.occupancy_sync()).async_factor() == pytest.approx(1.0)


@pytest.fixture(scope="module")
def kimi_long():
    args = ["--model", "kimi-k2", "--gpus", "64", "--rank", "128", "--response-len", "16384", "--json"]
    return args


def test_gpu_plan_prints_both_invariants(kimi_long, capsys):
    out = {}
    for name, lengths, k in (("long", "mean=4096,p99=16384", 4), ("fixed", "4096", 4)):
        assert main([*kimi_long, "--lengths", lengths, "--max-staleness", str(k)]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    for d in out.values():
        assert {"produced_tokens_per_s", "consumed_tokens_per_s", "produced_tokens_per_s_sync"} <= set(d["rates"])
        assert d["staleness"]["bound"] == 4 and 1 <= d["staleness"]["implied_max"] <= 4
        assert d["rates"]["consumed_tokens_per_s"] == pytest.approx(
            d["rates"]["consumption_samples_per_s"] * d["lengths"]["mean"])
    lo, fx = out["long"], out["fixed"]
    # fixed: the sync engine produces as fast while generating as the async one at the same concurrency
    assert fx["lengths"]["expected_longest_of_batch"] == 4096
    sync_gain = lambda d: d["steps_per_min"]["async"] / d["steps_per_min"]["sync"]
    assert sync_gain(lo) > sync_gain(fx)
    assert lo["times_s"]["rollout_sync_s"] > fx["times_s"]["rollout_sync_s"]
    assert lo["lengths"]["expected_longest_of_batch"] > 3 * lo["lengths"]["mean"]


def test_staleness_default_is_the_run_configs():
    from moe_lora_rl.plan.specs import RLSettings
    from moe_lora_rl.rl.config import TrainConfig
    assert RLSettings().staleness == TrainConfig.max_staleness == 1


@pytest.mark.parametrize("args, text", [
    (["--lengths", ""], "lengths '': empty"),
    (["--lengths", "-4096"], "lengths length='-4096': must be a finite number > 0"),
    (["--lengths", "mean=-1,p99=16"], "lengths mean='-1'"),
    (["--lengths", "p50=8000,p99=4000"], "percentiles out of order, p50=8000 is not below p99=4000"),
    (["--lengths", "mean=6000,p99=5000"], "mean=6000 is not below p99=5000"),
    (["--lengths", "mean=100,p99=8000"], "p99=8000 is too far above mean=100"),
    (["--lengths", "lots"], "lengths length='lots': not a number"),
    (["--lengths", "mean=4096"], "needs exactly two of mean, pNN"),
    (["--lengths", "p101=5,mean=4"], "key 'p101'"),
    (["--lengths", "512:0.5,x:0.5"], "length='x'"),
    (["--lengths", "512:0.5,1024"], "LENGTH:WEIGHT for every item"),
    (["--lengths", "9000"], "length 9000 is above the response cap 8192"),
    (["--ahead", "2"], "ahead=2: the staleness bound 1 cannot hold groups admitted 2 updates ahead"),
    (["--ahead", "0", "--max-staleness", "2"], "ahead=0"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--ahead", "3"], "--ahead=3: the staleness"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--lengths", "60:1,380:1"], "needs --batch"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--batch", "8", "--lengths", "p90=5,p10=9"],
     "--lengths: lengths 'p90=5,p10=9': percentiles out of order"),
    (["--host-cores", "2", "--rollout-s", "1,2", "--train-s", "1,2", "--batch", "8", "--lengths", "60",
      "--decode-fixed", "1.5"], "fixed_frac=1.5"),
])
def test_bad_lengths_and_ahead_one_line(args, text, capsys):
    assert main(args) == 2
    o = capsys.readouterr()
    assert o.out == "" and o.err.startswith("moe-lora-rl plan: error: ") and o.err.count("\n") == 1
    assert text in o.err and "Traceback" not in o.err
