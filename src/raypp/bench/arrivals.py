"""When an open-loop load test sends its requests: a seeded Poisson process.

:func:`poisson_offsets` is deterministic in ``(num, rate, seed)``: the first request
goes at 0 s, each later one an exponentially distributed gap (mean ``1 / rate``) after
the one before, the gaps drawn by ``numpy.random.default_rng(seed).exponential``.
Every rate shares the seed's draws, scaled by ``1 / rate``, so runs at different rates
send the same pattern faster or slower. ``rate = inf`` sends everything at 0 s.
"""

from __future__ import annotations

import math

import numpy as np


def poisson_offsets(num: int, rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the run's start, ascending (see module docstring)."""
    if num < 1:
        raise ValueError("the number of requests must be >= 1")
    if not rate > 0:
        raise ValueError(f"a request rate must be > 0 (or inf), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` → ``[1.0, 2.0, 4.0, inf]`` (requests per second, each > 0)."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"not a request rate: {part!r}") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"a request rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("no request rate given")
    return rates
