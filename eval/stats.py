"""Mean and Student-t confidence interval of per-seed measurements.

For n values x_1 … x_n with mean m and sample standard deviation s (ddof = 1):

    m ± t_{(1 + c) / 2, n - 1} · s / sqrt(n)          c = the confidence level (0.95)

With one value the interval is undefined (reported as None).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
from scipy import special

CONFIDENCE = 0.95


class Estimate(NamedTuple):
    """The mean of ``values`` and the half width of its ``confidence`` interval (None for n = 1)."""

    mean: float
    half_width: float | None
    values: tuple[float, ...]
    confidence: float = CONFIDENCE

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def to_json(self) -> dict:
        return {"mean": self.mean, "ci_half_width": self.half_width, "ci_low": self.low, "ci_high": self.high,
                "confidence": self.confidence, "n": len(self.values), "values": list(self.values)}

    def format(self, digits: int = 3) -> str:
        """``"m ± h"`` (or ``"m"`` when there is no interval)."""
        if self.half_width is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """The ``probability`` quantile of Student's t distribution."""
    return float(special.stdtrit(degrees_of_freedom, probability))


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """Mean ± the Student-t ``confidence`` interval of ``values`` (one per seed)."""
    samples = np.asarray(values, dtype=np.float64)
    if samples.ndim != 1 or samples.size == 0:
        raise ValueError(f"need a non-empty list of values, got shape {samples.shape}")
    mean = float(samples.mean())
    if samples.size == 1:
        return Estimate(mean, None, (mean,), confidence)
    standard_error = float(samples.std(ddof=1)) / math.sqrt(samples.size)
    half_width = t_quantile((1 + confidence) / 2, samples.size - 1) * standard_error
    return Estimate(mean, half_width, tuple(float(v) for v in samples), confidence)
