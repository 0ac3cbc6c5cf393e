"""Response-length distributions for the planner (pure): how long the answers of a batch are.

    d = parse_lengths("4096", cap=32768)                  # every answer 4096 tokens (the default: --response-len)
    d = parse_lengths("mean=4096,p99=16384", cap=32768)   # lognormal fitted to two of mean / pNN, clipped at cap
    d = parse_lengths("512:0.8,8192:0.2", cap=32768)      # an explicit mix, weights normalised
    d.mean, d.expected_max(n), d.alive_steps(n)           # what the rollout-time formulas read

Every distribution is held as a discrete one (sorted lengths, probabilities); a lognormal is cut into geometric bins,
each bin's mass at its conditional mean (so the mean is exact), the mass above the cap (the engine's max_tokens,
--response-len) at the cap. Lengths are in tokens and need not be integers.

Order statistics (David & Nagaraja, "Order Statistics", 3rd ed., 2003, sec. 2.1 and 3.1): of n independent draws,
the number still running after t decode steps is Binomial(n, S(t)) with S(t) = P(L > t); the expected number of
steps during which exactly k run is G_k = integral of P(Binomial(n, S(t)) = k) dt, and the expected longest
E[max] = sum_k G_k = integral of 1 - (1 - S(t))^n dt. For a discrete distribution S is a step function and the
integrals are exact sums."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from statistics import NormalDist

import numpy as np

_N = NormalDist()
_BINS = 1500


@dataclass(frozen=True)
class LengthDist:
    values: tuple[float, ...]     # sorted, distinct, > 0
    probs: tuple[float, ...]      # sum 1
    spec: str = field(default="", compare=False)

    @property
    def fixed(self) -> bool:
        return len(self.values) == 1

    @property
    def mean(self) -> float:
        return float(np.dot(self.values, self.probs))

    @property
    def decode_context(self) -> float:
        """The mean position of a decoded token in its answer, token-weighted: E[L^2] / (2 E[L]) (L/2 for one
        length): what a decode step's KV read and attention see on average, over and above the prompt."""
        v = np.asarray(self.values)
        return float(np.dot(v * v, self.probs) / (2 * self.mean))

    def _steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(decode steps in each interval between two lengths, P(L >= the interval's end))."""
        v = np.asarray(self.values)
        widths = np.diff(np.concatenate(([0.0], v)))
        surv = np.cumsum(np.asarray(self.probs)[::-1])[::-1].clip(0.0, 1.0)
        return widths, surv

    def expected_max(self, n: int) -> float:
        """E[max of n draws] = integral of 1 - (1 - S(t))^n dt."""
        widths, surv = self._steps()
        return float(np.dot(widths, 1.0 - (1.0 - surv) ** n))

    def alive_steps(self, n: int) -> tuple[float, ...]:
        """(G_1, ..., G_n): expected decode steps during which exactly k of n answers still run."""
        return _alive_steps(self, n)


@lru_cache(maxsize=64)
def _alive_steps(d: LengthDist, n: int) -> tuple[float, ...]:
    widths, surv = d._steps()
    k = np.arange(n + 1)
    log_c = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(n + 1)])
    s = surv[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = log_c[None, :] + np.where(k > 0, k * np.log(s), 0.0) + np.where(k < n, (n - k) * np.log1p(-s), 0.0)
    pmf = np.nan_to_num(np.exp(logp))
    return tuple(float(x) for x in (widths @ pmf)[1:])


def _number(key: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"lengths {key}={text!r}: not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"lengths {key}={text!r}: must be a finite number > 0")
    return v


def _percentile(key: str) -> float:
    try:
        q = float(key[1:])
    except ValueError:
        q = -1.0
    if not 0 < q < 100:
        raise ValueError(f"lengths key {key!r}: expected 'mean' or pNN with 0 < NN < 100 (e.g. p99)")
    return q


def lognormal(mu: float, sigma: float, cap: float, spec: str = "", bins: int = _BINS) -> LengthDist:
    """ln L ~ Normal(mu, sigma), clipped at cap, cut into geometric bins from the 1e-7 quantile (its mass below goes
    to the first bin); each bin holds its conditional mean, E[L; a < L <= b] = e^(mu + sigma^2/2) *
    [Phi((ln b - mu - sigma^2)/sigma) - Phi((ln a - mu - sigma^2)/sigma)] (the lognormal partial expectation)."""
    lo, hi = math.exp(mu + sigma * _N.inv_cdf(1e-7)), math.log(cap)
    if lo >= cap:
        return LengthDist((cap,), (1.0,), spec)
    edges = [math.exp(math.log(lo) + (hi - math.log(lo)) * i / bins) for i in range(bins + 1)]
    m = math.exp(mu + sigma * sigma / 2)
    cdf = [_N.cdf((math.log(e) - mu) / sigma) for e in edges]
    part = [m * _N.cdf((math.log(e) - mu - sigma * sigma) / sigma) for e in edges]
    cdf[0], part[0] = 0.0, 0.0                     # the tail below lo joins the first bin
    vals, probs = [], []
    for i in range(bins):
        p = cdf[i + 1] - cdf[i]
        if p > 0:
            vals.append(min(edges[i + 1], max(edges[i] if i else 0.0, (part[i + 1] - part[i]) / p)))
            probs.append(p)
    if 1 - cdf[-1] > 0:
        vals.append(cap)
        probs.append(1 - cdf[-1])
    return _merge(vals, probs, spec)


def _merge(vals, probs, spec) -> LengthDist:
    acc: dict[float, float] = {}
    for v, p in zip(vals, probs):
        acc[v] = acc.get(v, 0.0) + p
    total = sum(acc.values())
    keys = sorted(acc)
    return LengthDist(tuple(keys), tuple(acc[k] / total for k in keys), spec)


def _fit(pairs: list[tuple[str, float]], cap: float, spec: str) -> LengthDist:
    keys = [k for k, _ in pairs]
    if len(pairs) != 2 or len(set(keys)) != 2:
        raise ValueError(f"lengths {spec!r}: a lognormal needs exactly two of mean, pNN (e.g. mean=4096,p99=16384); "
                         "a fixed length is one number, a mix LENGTH:WEIGHT,...")
    vals = dict(pairs)
    if "mean" in vals:
        mean = vals["mean"]
        key = next(k for k in keys if k != "mean")
        q, pq = _percentile(key), vals[key]
        z = _N.inv_cdf(q / 100)
        if (q > 50) != (pq > mean):
            why = "upper percentiles lie above its mean" if q > 50 else "mean lies above its median and below"
            raise ValueError(f"lengths {spec!r}: mean={mean:g} is not {'below' if q > 50 else 'above'} {key}="
                             f"{pq:g}: a long-tailed (lognormal) distribution's {why}")
        disc = z * z - 2 * math.log(pq / mean)
        if disc < 0:
            raise ValueError(f"lengths {spec!r}: {key}={pq:g} is too far above mean={mean:g} for a lognormal (at "
                             f"most {mean * math.exp(z * z / 2):.0f})")
        sigma = z - math.sqrt(disc) if z > 0 else z + math.sqrt(disc)
        mu = math.log(mean) - sigma * sigma / 2
    else:
        (ka, a), (kb, b) = sorted(pairs, key=lambda kv: _percentile(kv[0]))
        if not a < b:
            raise ValueError(f"lengths {spec!r}: percentiles out of order, {ka}={a:g} is not below {kb}={b:g}")
        za, zb = _N.inv_cdf(_percentile(ka) / 100), _N.inv_cdf(_percentile(kb) / 100)
        sigma = (math.log(b) - math.log(a)) / (zb - za)
        mu = math.log(a) - sigma * za
    for k, v in pairs:
        if v > cap:
            raise ValueError(f"lengths {spec!r}: {k}={v:g} is above the response cap {cap:g} (--response-len)")
    return lognormal(mu, sigma, cap, spec)


@lru_cache(maxsize=64)
def parse_lengths(text: str, cap: float) -> LengthDist:
    """A length distribution from its command-line form (module docstring); ValueError naming the value."""
    spec = (text or "").strip()
    if not spec:
        raise ValueError("lengths '': empty; give a length (4096), mean=M,pNN=Q, or LENGTH:WEIGHT,...")
    parts = [p.strip() for p in spec.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"lengths {spec!r}: an empty item")
    if all("=" in p for p in parts):
        pairs = []
        for p in parts:
            k, v = (s.strip() for s in p.split("=", 1))
            if k != "mean":
                _percentile(k)
            pairs.append((k, _number(k, v)))
        return _fit(pairs, cap, spec)
    if any("=" in p for p in parts):
        raise ValueError(f"lengths {spec!r}: mixes key=value and plain items")
    vals, probs = [], []
    for p in parts:
        length, _, weight = p.partition(":")
        v = _number("length", length.strip())
        w = _number("weight", weight.strip()) if _ else 1.0
        if v > cap:
            raise ValueError(f"lengths {spec!r}: length {v:g} is above the response cap {cap:g} (--response-len)")
        vals.append(v)
        probs.append(w)
    if len(parts) > 1 and not all(":" in p for p in parts):
        raise ValueError(f"lengths {spec!r}: a mix needs LENGTH:WEIGHT for every item")
    return _merge(vals, probs, spec)
