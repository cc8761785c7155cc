"""Response lengths as a distribution: what a synchronous rollout waits for is its longest response.

A :class:`LengthDistribution` is a small weighted set of lengths (a histogram), built from a mean and a
maximum (a lognormal, the default shape), from observed lengths, or from a run's ``metrics.jsonl``.
Training and forward passes see the mean (remove-padding packs sequences); padded passes see the max;
the rollout sees the whole shape (see :mod:`hybridflow.planner.rollout`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from pathlib import Path
from statistics import NormalDist

from hybridflow.planner.metrics_file import metric, metrics_rows

# The cap sits at this quantile of the fitted lognormal: responses longer than the cap are truncated to it.
MAX_QUANTILE = 0.999
# Probability edges of the histogram built from a lognormal: even in the body, dense in the tail, where
# the longest of a few thousand responses lives.
_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 0.999, 1.0)
# ``metrics.jsonl`` keys holding a step's mean and max response length (hybridflow and verl names).
MEAN_KEYS = ("response_length/mean", "response_len_mean", "rollout/response_len_mean")
MAX_KEYS = ("response_length/max", "response_len_max", "rollout/response_len_max")


@dataclass(frozen=True)
class LengthDistribution:
    """Response lengths in tokens: ``points`` are ``(length, probability)`` pairs, lengths ascending."""

    points: tuple[tuple[float, float], ...]
    shape: str = "histogram"

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("LengthDistribution.points is empty; give at least one (length, probability)")
        total = sum(p for _, p in self.points)
        if any(p < 0 for _, p in self.points) or not math.isclose(total, 1.0, rel_tol=1e-6):
            raise ValueError(f"LengthDistribution.points: probabilities must be >= 0 and sum to 1 (sum {total})")
        if any(length <= 0 for length, _ in self.points):
            raise ValueError("LengthDistribution.points: every length must be positive (tokens)")
        if list(self.points) != sorted(self.points):
            raise ValueError("LengthDistribution.points must be sorted by length")

    @classmethod
    def point(cls, length: float) -> LengthDistribution:
        """Every response has the same length (the old single-length model)."""
        if not length > 0:
            raise ValueError(f"response length {length!r} must be positive")
        return cls(((float(length), 1.0),), shape="point")

    @classmethod
    def lognormal(cls, *, mean: float, max: float) -> LengthDistribution:
        """A lognormal with this mean whose ``MAX_QUANTILE`` quantile is ``max``; longer ones are cut to ``max``.

        With ``mu + sigma²/2 = ln(mean)`` and ``mu + z·sigma = ln(max)``: ``sigma = z - sqrt(z² - 2 ln(max/mean))``
        (the smaller root: the narrower distribution that fits both).
        """
        if not 0 < mean <= max:
            raise ValueError(f"response lengths: need 0 < mean ({mean}) <= max ({max}); give the mean response "
                             "length and the response length cap")
        if mean == max:
            return cls.point(mean)
        z = NormalDist().inv_cdf(MAX_QUANTILE)
        gap = 2 * math.log(max / mean)
        if gap > z * z:
            raise ValueError(f"response lengths: max/mean = {max / mean:.0f} is too wide for a lognormal "
                             f"(at most {math.exp(z * z / 2):.0f}); give a histogram instead")
        sigma = z - math.sqrt(z * z - gap)
        if sigma <= 0:  # max within a rounding error of the mean
            return cls.point(mean)
        mu = math.log(mean) - sigma * sigma / 2
        normal = NormalDist(mu, sigma)
        raw = [(math.exp(normal.inv_cdf((low + high) / 2)), high - low)
               for low, high in pairwise(_EDGES)]
        # Midpoint quantiles and the cut at ``max`` shift the mean a little: rescale the body to keep it.
        scale = 1.0
        for _ in range(8):
            points = [(min(length * scale, float(max)), p) for length, p in raw]
            scale *= mean / sum(length * p for length, p in points)
        return cls(_merged(points), shape="lognormal")

    @classmethod
    def from_lengths(cls, lengths: Iterable[float]) -> LengthDistribution:
        """The empirical distribution of observed response lengths."""
        values = sorted(float(x) for x in lengths)
        if not values:
            raise ValueError("LengthDistribution.from_lengths: no lengths given")
        return cls(_merged([(x, 1 / len(values)) for x in values]), shape="histogram")

    @classmethod
    def from_metrics(cls, path: str | Path) -> LengthDistribution:
        """A lognormal fitted to a run's mean of per-step mean lengths and its largest max (``metrics.jsonl``)."""
        means, maxes = [], []
        for number, record in metrics_rows(path):
            mean = next((metric(path, number, record, k) for k in MEAN_KEYS if k in record), None)
            top = next((metric(path, number, record, k) for k in MAX_KEYS if k in record), None)
            if mean is not None:
                means.append(mean)
            if top is not None:
                maxes.append(top)
        if not means:
            raise ValueError(f"{path}: no response length in any record; expected one of {list(MEAN_KEYS)}")
        mean = sum(means) / len(means)
        return cls.lognormal(mean=mean, max=max(maxes, default=mean))

    @cached_property
    def mean(self) -> float:
        return sum(length * p for length, p in self.points)

    @cached_property
    def second_moment(self) -> float:
        return sum(length * length * p for length, p in self.points)

    @property
    def max(self) -> float:
        return self.points[-1][0]

    @cached_property
    def _cumulative(self) -> tuple[float, ...]:
        total, out = 0.0, []
        for _, p in self.points:
            total += p
            out.append(total)
        return tuple(out)

    def quantile(self, q: float) -> float:
        """The smallest length whose cumulative probability reaches ``q``."""
        for (length, _), cumulative in zip(self.points, self._cumulative, strict=True):
            if cumulative >= q - 1e-12:
                return length
        return self.max

    def expected_max(self, samples: int) -> float:
        """Roughly the longest of ``samples`` responses: the ``samples / (samples + 1)`` quantile."""
        return self.quantile(samples / (samples + 1))

    def mean_age(self) -> float:
        """Mean tokens decoded so far by a sequence in flight under continuous batching (length-biased)."""
        return self.second_moment / (2 * self.mean)

    def survivors(self, cap: float) -> list[tuple[float, float, float]]:
        """``(start, end, fraction still decoding)`` segments of decode steps up to ``cap``."""
        segments, previous, alive = [], 0.0, 1.0
        for length, p in self.points:
            end = min(length, cap)
            if end > previous:
                segments.append((previous, end, alive))
                previous = end
            alive -= p
        if previous < cap:
            segments.append((previous, cap, max(alive, 0.0)))
        return segments

    def describe(self) -> str:
        return f"{self.shape} mean {self.mean:.0f}, max {self.max:.0f} tokens"


def _merged(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Equal lengths as one point (a clipped tail piles up at the cap)."""
    merged: list[tuple[float, float]] = []
    for length, p in sorted(points):
        if merged and math.isclose(merged[-1][0], length):
            merged[-1] = (merged[-1][0], merged[-1][1] + p)
        else:
            merged.append((length, p))
    total = sum(p for _, p in merged)
    return tuple((length, p / total) for length, p in merged)
