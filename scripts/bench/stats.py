"""Figures of the benchmark: median with spread, and the analytic speedup predictions."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specjax import verify


def summarize(values: Sequence[float]) -> dict:
    """Median with spread: min, max, IQR (linear quantiles) and n."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
            "q1": float(np.quantile(v, 0.25)), "q3": float(np.quantile(v, 0.75)), "n": int(v.size)}


def expected_tokens(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha): expected tokens per round with i.i.d. acceptance
    (:func:`specjax.verify.expected_tokens_per_round`); NaN for an unknown alpha."""
    if alpha is None or not math.isfinite(alpha):
        return float("nan")
    return float(verify.expected_tokens_per_round(alpha, k))


def predicted_speedup(alpha: float, k: int, c: float, verify_ratio: float = 1.0) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha)(cK + v)); v = 1 is the textbook formula (Leviathan
    et al.), v = t_target(K+1 tokens) / t_target(1 token) adds the verification cost."""
    return expected_tokens(alpha, k) / (c * k + verify_ratio)
