"""Small value distributions for agent inputs: turns per trajectory and tool latency (seconds). Torch-free.

A batch-synchronous turn waits for the slowest tool of the batch, so besides the mean every distribution
gives :meth:`Distribution.expected_max`, the expected largest of ``n`` independent draws (an order
statistic). Three kinds parse from text (``parse_distribution``): ``fixed:2``, ``lognormal:median=0.1,sigma=1.0``
and ``empirical:0.1,0.3,2.0``; sums of draws (:meth:`Distribution.sum_of`) and mixtures (:class:`Mixture`)
are what the agent cost model builds from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

EXAMPLES = "fixed:2, lognormal:median=0.1,sigma=1.0 or empirical:0.1,0.3,2.0"
_STD = NormalDist()
_POINTS = 400  # Simpson intervals of the numeric order-statistic integrals (even)
_TAIL = 1e-4  # the integrals stop where F(x)^n is within this of 1


class Distribution:
    """A non-negative random value. Subclasses give ``mean``, ``variance``, ``cdf`` and ``quantile``."""

    @property
    def mean(self) -> float:
        raise NotImplementedError

    @property
    def variance(self) -> float:
        raise NotImplementedError

    def cdf(self, x: float) -> float:
        raise NotImplementedError

    def quantile(self, q: float) -> float:
        raise NotImplementedError

    def expected_max(self, n: int) -> float:
        """E[max of ``n`` draws]: ``∫₀^∞ 1 - F(x)^n dx`` by Simpson's rule up to where ``F^n`` reaches 1 (within
        ``_TAIL``); the mean at n = 1. Kinds with a closed form or a sharper integral override it."""
        if n <= 1:
            return self.mean
        return _max_integral(self.cdf, n, self.quantile(1 - _TAIL / n))

    def sum_of(self, count: int) -> Distribution:
        """The sum of ``count`` independent draws: a lognormal with the sum's mean and variance (Fenton and
        Wilkinson 1960: the usual approximation of a sum of lognormals, good in the body and upper tail for
        the sigmas of tool latencies); kinds with an exact sum override it."""
        if count <= 0:
            return Fixed(0.0)
        if count == 1:
            return self
        return Lognormal.matching(count * self.mean, count * self.variance)

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(Distribution):
    """Always ``value``."""

    value: float

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ValueError(f"fixed value {self.value!r} must be >= 0 (e.g. {EXAMPLES})")

    @property
    def mean(self) -> float:
        return self.value

    @property
    def variance(self) -> float:
        return 0.0

    def cdf(self, x: float) -> float:
        return 1.0 if x >= self.value else 0.0

    def quantile(self, q: float) -> float:
        return self.value

    def expected_max(self, n: int) -> float:
        return self.value

    def sum_of(self, count: int) -> Distribution:
        return Fixed(self.value * max(count, 0))

    def describe(self) -> str:
        return f"fixed {self.value:g}"


@dataclass(frozen=True)
class Lognormal(Distribution):
    """``exp(N(ln median, sigma²))``: long-tailed, as tool latencies are (mean ``median·exp(sigma²/2)``)."""

    median: float
    sigma: float

    def __post_init__(self) -> None:
        if not self.median > 0 or not self.sigma >= 0:
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got median={self.median!r}, "
                             f"sigma={self.sigma!r} (e.g. lognormal:median=0.1,sigma=1.0)")

    @classmethod
    def matching(cls, mean: float, variance: float) -> Distribution:
        """The lognormal of this mean and variance (a fixed value when the variance is 0)."""
        if mean <= 0 or variance <= 0:
            return Fixed(max(mean, 0.0))
        sigma2 = math.log1p(variance / (mean * mean))
        return cls(median=mean * math.exp(-sigma2 / 2), sigma=math.sqrt(sigma2))

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma ** 2 / 2)

    @property
    def variance(self) -> float:
        return self.mean ** 2 * math.expm1(self.sigma ** 2)

    def cdf(self, x: float) -> float:
        if x <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if x >= self.median else 0.0
        return _STD.cdf(math.log(x / self.median) / self.sigma)

    def quantile(self, q: float) -> float:
        return self.median * math.exp(self.sigma * _STD.inv_cdf(min(max(q, 1e-12), 1 - 1e-12)))

    def expected_max(self, n: int) -> float:
        """``E = ∫ median·e^{σz} · n Φ(z)^{n-1} φ(z) dz`` over the standard normal ``z`` (the max's density in
        z), by Simpson's rule on [-8, max(8, σ) + 8]: smooth at every n, unlike the integral in x."""
        if n <= 1 or self.sigma == 0:
            return self.mean
        return _lognormal_max(self.median, self.sigma, n)

    def describe(self) -> str:
        return f"lognormal median {self.median:g}, sigma {self.sigma:g} (mean {self.mean:.3g})"


@dataclass(frozen=True)
class Empirical(Distribution):
    """Observed values, equally likely (``points``: ``(value, probability)`` pairs, values ascending)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"empirical distribution has no values (e.g. {EXAMPLES})")
        if any(v < 0 or p < 0 for v, p in self.points) or not math.isclose(sum(p for _, p in self.points), 1.0,
                                                                            rel_tol=1e-6):
            raise ValueError("empirical points need values >= 0 and probabilities >= 0 summing to 1")

    @classmethod
    def of(cls, samples: Sequence[float]) -> Empirical:
        values = sorted(float(x) for x in samples)
        if not values:
            raise ValueError(f"empirical distribution has no values (e.g. {EXAMPLES})")
        return cls(_merged([(x, 1 / len(values)) for x in values]))

    @property
    def mean(self) -> float:
        return sum(v * p for v, p in self.points)

    @property
    def variance(self) -> float:
        return max(0.0, sum(v * v * p for v, p in self.points) - self.mean ** 2)

    def cdf(self, x: float) -> float:
        return min(1.0, sum(p for v, p in self.points if v <= x))

    def quantile(self, q: float) -> float:
        total = 0.0
        for value, p in self.points:
            total += p
            if total >= q - 1e-12:
                return value
        return self.points[-1][0]

    def expected_max(self, n: int) -> float:
        """Exact: ``Σ x_i (F(x_i)^n - F(x_{i-1})^n)``."""
        total, below, previous = 0.0, 0.0, 0.0
        for value, p in self.points:
            below += p
            current = min(below, 1.0) ** max(n, 1)
            total += value * (current - previous)
            previous = current
        return total

    def sum_of(self, count: int) -> Distribution:
        """Exact convolution while it stays small (at most 4096 distinct sums), else the moment-matched lognormal."""
        if count <= 0:
            return Fixed(0.0)
        if len(self.points) ** count > 4096:
            return super().sum_of(count)
        sums = [(0.0, 1.0)]
        for _ in range(count):
            sums = list(_merged([(s + v, q * p) for s, q in sums for v, p in self.points]))
        return Empirical(tuple(sums))

    def describe(self) -> str:
        return f"empirical of {len(self.points)} values (mean {self.mean:.3g})"


@dataclass(frozen=True)
class Mixture(Distribution):
    """``offset + X`` with probability ``p`` for each ``(p, offset, X)`` component."""

    components: tuple[tuple[float, float, Distribution], ...]

    @property
    def mean(self) -> float:
        return sum(p * (offset + d.mean) for p, offset, d in self.components)

    @property
    def variance(self) -> float:
        second = sum(p * (d.variance + (offset + d.mean) ** 2) for p, offset, d in self.components)
        return max(0.0, second - self.mean ** 2)

    def cdf(self, x: float) -> float:
        return sum(p * d.cdf(x - offset) for p, offset, d in self.components)

    def expected_max(self, n: int) -> float:
        """Exact for components that are all fixed values; else the numeric integral."""
        if all(isinstance(d, Fixed) for _, _, d in self.components):
            points = _merged([(offset + d.mean, p) for p, offset, d in self.components if p > 0])
            return Empirical(points).expected_max(n)
        return super().expected_max(n)

    def quantile(self, q: float) -> float:
        """An upper bound of the ``q`` quantile (the largest component quantile): where the integrals may stop."""
        return max(offset + d.quantile(q) for _, offset, d in self.components)

    def describe(self) -> str:
        return f"mixture of {len(self.components)} (mean {self.mean:.3g})"


def parse_distribution(text: str | float | int | Distribution, *, field: str) -> Distribution:
    """``fixed:V``, ``lognormal:median=M,sigma=S``, ``empirical:V1,V2,...`` or a bare number (fixed); errors name
    ``field``."""
    if isinstance(text, Distribution):
        return text
    if isinstance(text, bool):
        raise ValueError(f"{field}={text!r} is not a distribution; write {EXAMPLES}")
    if isinstance(text, int | float):
        return _built(field, text, lambda: Fixed(float(text)))
    kind, _, body = str(text).strip().partition(":")
    kind = kind.strip().lower()
    try:
        if not body:
            if kind in ("fixed", "lognormal", "empirical"):
                raise ValueError(f"{kind} has no values")
            return Fixed(float(kind))
        if kind == "fixed":
            return Fixed(float(body))
        if kind == "empirical":
            return Empirical.of([float(part) for part in body.split(",") if part.strip()])
        if kind == "lognormal":
            values = dict(_pair(part) for part in body.split(","))
            unknown = sorted(set(values) - {"median", "sigma"})
            if unknown or set(values) != {"median", "sigma"}:
                raise ValueError(f"lognormal takes median= and sigma=, got {sorted(values)}")
            return Lognormal(median=values["median"], sigma=values["sigma"])
    except ValueError as err:
        raise ValueError(f"{field}={text!r}: {err}; write {EXAMPLES}") from err
    raise ValueError(f"{field}={text!r}: unknown kind {kind!r}; write {EXAMPLES}")


def _built(field: str, text: object, make: Callable[[], Distribution]) -> Distribution:
    try:
        return make()
    except ValueError as err:
        raise ValueError(f"{field}={text!r}: {err}") from err


def _pair(part: str) -> tuple[str, float]:
    key, sep, value = part.partition("=")
    if not sep:
        raise ValueError(f"{part.strip()!r} is not key=value")
    return key.strip().lower(), float(value)


def _merged(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    merged: list[tuple[float, float]] = []
    for value, p in sorted(points):
        if merged and math.isclose(merged[-1][0], value, rel_tol=1e-9, abs_tol=1e-12):
            merged[-1] = (merged[-1][0], merged[-1][1] + p)
        else:
            merged.append((value, p))
    total = sum(p for _, p in merged)
    return tuple((value, p / total) for value, p in merged)


def _simpson(fn: Callable[[float], float], low: float, high: float, points: int = _POINTS) -> float:
    step = (high - low) / points
    total = fn(low) + fn(high)
    for i in range(1, points):
        total += (4 if i % 2 else 2) * fn(low + i * step)
    return total * step / 3


def _max_integral(cdf: Callable[[float], float], n: int, high: float) -> float:
    """``∫₀^high 1 - F(x)^n dx``, the expected max of ``n`` draws of a non-negative value below ``high``."""
    if high <= 0:
        return 0.0
    return _simpson(lambda x: 1.0 - cdf(x) ** n, 0.0, high)


@lru_cache(maxsize=4096)
def _lognormal_max(median: float, sigma: float, n: int) -> float:
    high = max(8.0, sigma) + 8.0

    def density(z: float) -> float:
        return median * math.exp(sigma * z) * n * _STD.cdf(z) ** (n - 1) * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

    return _simpson(density, -8.0, high, 2 * _POINTS)
